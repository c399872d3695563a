"""`POST /tokenize`: token ids of a text, as vLLM and llama-server answer it.

Body: `prompt` (vLLM) or `content` (llama-server), optional `model` and `add_special`
(default false: the text alone, no BOS). Answer: `tokens`, `count` and `max_model_len`, so a
client can split a long document on token counts before sending it.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from localllm.server.errors import APIError, parse_body
from localllm.server.state import ServerState


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    prompt: str | None = None
    content: str | None = None
    add_special: bool = False


async def tokenize(request: Request) -> Response:
    s: ServerState = request.app.state.serve
    body = await parse_body(request, TokenizeRequest)
    s.check_model(body.model)
    text = body.prompt if body.prompt is not None else body.content
    if text is None:
        raise APIError(400, "give the text to tokenize as 'prompt' (or 'content')", "prompt")
    ids = s.llm.tokenizer.encode(text, add_special=body.add_special)
    return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": s.max_model_len})
