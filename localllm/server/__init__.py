"""`localllm serve`: an OpenAI- and Ollama-compatible HTTP API over the async engine, on a Unix
socket (and loopback TCP with an API key). `build_app` makes the ASGI app; `transport` binds
the sockets; `runner` runs uvicorn with a clean shutdown."""
