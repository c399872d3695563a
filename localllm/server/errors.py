"""Errors as the clients expect them: OpenAI's `{"error": {"message", "type", "param", "code"}}`
on `/v1` and everywhere else, Ollama's `{"error": "message"}` on `/api`.

`APIError` is raised by the routes for input a client chose (a 4xx with a message that says
what to fix) and for a request that failed in the engine (a 500 for that request alone).
`parse_body` reads a JSON body into a pydantic model and turns pydantic's errors into one line.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse

M = TypeVar("M", bound=BaseModel)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 503: "server_error"}
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function", "literal"}


class APIError(Exception):
    """An error answered as JSON with `status`; `param` names the offending field."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def is_ollama_path(path: str) -> bool:
    return path == "/api" or path.startswith("/api/")


def error_body(path: str, status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    if is_ollama_path(path):
        return {"error": message}
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(path: str, status: int, message: str, param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(error_body(path, status, message, param, code), status, headers)


def _field(loc: tuple[Any, ...]) -> str:
    """A pydantic location as a field path (`messages[0].content`), without union tags."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
            continue
        tag = str(part)
        if "[" in tag or tag in _TYPE_TAGS or tag[:1].isupper():
            continue  # the member of a union that was tried, or a model class name
        out += f".{tag}" if out else tag
    return out


def validation_message(err: ValidationError) -> tuple[str, str | None]:
    """One line for the first field pydantic refused (all the ways it tried, for a union)."""
    errors = err.errors(include_url=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        why = first["msg"].removeprefix("Invalid JSON: ")
        return f"the request body is not valid JSON: {why}", None
    field = _field(first["loc"])
    if first["type"] == "extra_forbidden":
        return f"unknown field '{field}'; remove it (see the API reference for the fields)", field
    msgs = list(dict.fromkeys(e["msg"] for e in errors if _field(e["loc"]) == field))
    if not field:
        return f"the request body: {' or '.join(msgs)}", None
    return f"{field}: {' or '.join(m[0].lower() + m[1:] for m in msgs)}", field


async def parse_body(request: Request, model: type[M]) -> M:
    """The request's JSON body as `model`, or an APIError 400 saying what is wrong."""
    body = await request.body()
    if not body.strip():
        raise APIError(400, "the request has no body; send a JSON object")
    try:
        return model.model_validate_json(body, strict=True)
    except ValidationError as e:
        message, param = validation_message(e)
        raise APIError(400, message, param) from None
    except (ValueError, json.JSONDecodeError) as e:  # a model validator's own check
        raise APIError(400, str(e)) from None
