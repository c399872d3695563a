"""Programs on top of the engine: chat, serve, summarize, bench, and the `localllm` CLI."""
