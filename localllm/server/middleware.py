"""The ASGI layer in front of the routes (plain ASGI, so streamed responses pass untouched):

- the API key: a request that came over TCP needs `Authorization: Bearer KEY` (401 without it
  or with another key); requests over the Unix socket need none (the socket's mode 0600 lets
  only its owner connect);
- the body size limit: a body over the limit gets 413 before any route reads it;
- one access-log line per request once its response has ended: client, method, path, status
  ("client went away" after it when the client left before the end of the answer), time,
  bytes, and the prompt and completion token counts a route noted (the prompt text only with
  `--log-prompts`).
"""

from __future__ import annotations

import hmac
import json
import logging
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from localllm.server.common import LOG_KEY
from localllm.server.errors import error_body
from localllm.server.state import ServerState

access = logging.getLogger("localllm.access")
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/api/chat", "/api/generate",
          "/api/tags", "/api/show", "/api/ps", "/api/version", "/completion", "/completions",
          "/infill", "/props", "/tokenize", "/health", "/metrics", "/")


def route_label(path: str) -> str:
    """The `route` label of `localllm_http_requests_total`: the route, or "other"."""
    if path.startswith("/v1/models/"):
        return "/v1/models/{model}"
    return path if path in ROUTES else "other"


def over_tcp(scope: Scope) -> bool:
    """uvicorn gives a TCP connection's `server` as (host, port), a Unix socket's as (path,
    None) or None."""
    server = scope.get("server")
    return isinstance(server, (tuple, list)) and len(server) == 2 and server[1] is not None


def key_matches(scope: Scope, key: str) -> bool:
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            scheme, _, given = value.decode("latin-1").partition(" ")
            return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(),
                                                                      key.encode())
    return False


class LocalAPIMiddleware:
    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        info: dict[str, Any] = {"status": 0, "bytes": 0}
        scope[LOG_KEY] = {}

        async def logged_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                info["status"] = message["status"]
            elif message["type"] == "http.response.body":
                info["bytes"] += len(message.get("body", b""))
                info["ended"] = not message.get("more_body", False)
            await send(message)

        async def watched_receive() -> Message:
            message = await receive()
            if message["type"] == "http.disconnect" and not info.get("ended"):
                info["gone"] = True  # before the whole answer went out
            return message

        try:
            await self._handle(scope, watched_receive, logged_send)
        finally:
            self._log(scope, info, time.perf_counter() - start)

    async def _handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if over_tcp(scope):
            key = self.state.options.api_key
            if key is None or not key_matches(scope, key):
                why = ("missing API key" if not any(n == b"authorization"
                                                    for n, _ in scope.get("headers", []))
                       else "invalid API key")
                await _reply(send, path, 401, f"{why}: requests over TCP need the header "
                             f"'Authorization: Bearer KEY' with the server's --api-key")
                return
        limit = self.state.options.max_body_bytes
        length = dict(scope.get("headers", [])).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await _reply(send, path, 413, f"the request body has {int(length)} bytes; the limit "
                         f"is {limit} (--max-request-bytes)")
            return
        body = b""
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away before sending its body
            body += message.get("body", b"")
            if len(body) > limit:
                await _reply(send, path, 413, f"the request body has more than {limit} bytes, "
                             f"the limit (--max-request-bytes)")
                return
            if not message.get("more_body", False):
                break
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _log(self, scope: Scope, info: dict[str, Any], seconds: float) -> None:
        path = scope.get("path", "")
        self.state.metrics.http.labels(route_label(path), str(info["status"])).inc()
        if not access.isEnabledFor(logging.INFO):
            return
        client = scope.get("client")
        who = f"{client[0]}:{client[1]}" if client and client[1] is not None else "unix"
        facts: dict[str, Any] = dict(scope.get(LOG_KEY, {}))
        prompt = facts.pop("prompt", None)
        extra = " ".join(f"{k}={v}" for k, v in facts.items())
        gone = " client went away" if info.get("gone") else ""
        line = (f"{who} {scope.get('method', '')} {path} {info['status']}{gone} "
                f"{seconds * 1000:.0f}ms {info['bytes']}B {extra}").rstrip()
        if self.state.options.log_prompts and prompt is not None:
            line += " prompt=" + json.dumps(prompt, ensure_ascii=False)
        access.info("%s", line)


async def _reply(send: Send, path: str, status: int, message: str) -> None:
    """An error answered here, before the app."""
    body = json.dumps(error_body(path, status, message)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
