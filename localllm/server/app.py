"""The ASGI application of `localllm serve`: Starlette routes for the OpenAI- and
Ollama-compatible APIs, llama-server's `/completion` and `/infill`, and operations, behind
`LocalAPIMiddleware` (API key, body limit, access log) and, for the origins `--cors-origin`
names, Starlette's CORS middleware. Every error is JSON in the style of the API it concerns,
with the status that fits; an unexpected failure answers that one request with a 500 and leaves
the others running.
"""

from __future__ import annotations

import logging

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp

from localllm.server import info, llamacpp_api, ollama_api
from localllm.server.common import access_log
from localllm.server.errors import APIError, error_response
from localllm.server.middleware import LocalAPIMiddleware
from localllm.server.openai_chat import chat_completions
from localllm.server.openai_completions import completions
from localllm.server.state import ServerState
from localllm.server.tokenize import tokenize

log = logging.getLogger("localllm.serve")

ROUTES = [
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/models", info.models, methods=["GET"]),
    Route("/v1/models/{model:path}", info.model, methods=["GET"]),
    Route("/api/chat", ollama_api.chat, methods=["POST"]),
    Route("/api/generate", ollama_api.generate, methods=["POST"]),
    Route("/api/tags", info.tags, methods=["GET"]),
    Route("/api/show", info.show, methods=["POST"]),
    Route("/api/ps", info.ps, methods=["GET"]),
    Route("/api/version", info.version, methods=["GET"]),
    Route("/completion", llamacpp_api.completion, methods=["POST"]),
    Route("/completions", llamacpp_api.completion, methods=["POST"]),  # llama-server's alias
    Route("/infill", llamacpp_api.infill, methods=["POST"]),
    Route("/props", info.props, methods=["GET"]),
    Route("/tokenize", tokenize, methods=["POST"]),
    Route("/health", info.health, methods=["GET"]),
    Route("/metrics", info.metrics, methods=["GET"]),
    Route("/", info.root, methods=["GET", "HEAD"]),
]


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    access_log(request)["error"] = repr(exc.message)
    return error_response(request.url.path, exc.status, exc.message, exc.param, exc.code)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    message = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on "
               f"{request.url.path}"}.get(exc.status_code, str(exc.detail))
    return error_response(request.url.path, exc.status_code, message)


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    return error_response(request.url.path, 500, f"internal error: {type(exc).__name__}: {exc}")


def build_app(state: ServerState) -> ASGIApp:
    app = Starlette(routes=ROUTES, exception_handlers={
        APIError: _api_error, HTTPException: _http_error, Exception: _unexpected})
    app.state.serve = state
    guarded = LocalAPIMiddleware(app, state)
    origins = list(state.options.cors_origins)
    if not origins:
        return guarded
    # outside the API key check: a browser's preflight (OPTIONS) carries no key; the request
    # it clears still needs one over TCP
    return CORSMiddleware(guarded, allow_origins=origins, allow_methods=["GET", "POST", "HEAD"],
                          allow_headers=["Authorization", "Content-Type"], max_age=600)
