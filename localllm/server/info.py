"""Routes that describe the server: `/health`, `/metrics`, OpenAI's `/v1/models`, Ollama's
`/api/tags`, `/api/show`, `/api/ps`, `/api/version` (what Zed and Continue read to list the
model, its context length and its capabilities), and llama-server's `/props` (its context,
slots, chat template and default sampling, as llama.cpp's clients read them)."""

from __future__ import annotations

from datetime import UTC, datetime
from importlib import metadata as importlib_metadata
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from localllm.model_card import file_size, parameter_count, quantization, size_label
from localllm.server.errors import parse_body
from localllm.server.metrics import CONTENT_TYPE
from localllm.server.ollama_schemas import ShowRequest
from localllm.server.params import DEFAULTS
from localllm.server.state import ServerState


def _state(request: Request) -> ServerState:
    return request.app.state.serve  # type: ignore[no-any-return]


def _details(state: ServerState) -> dict[str, Any]:
    arch = state.llm.config.arch
    return {"parent_model": "", "format": "gguf" if state.llm.path.is_file() else "safetensors",
            "family": arch, "families": [arch],
            "parameter_size": size_label(parameter_count(state.llm.config)),
            "quantization_level": quantization(state.metadata)}


def _modified(state: ServerState) -> str:
    mtime = state.llm.path.stat().st_mtime
    return datetime.fromtimestamp(mtime, UTC).isoformat().replace("+00:00", "Z")


def _ollama_name(state: ServerState) -> str:
    return state.model_name if ":" in state.model_name else f"{state.model_name}:latest"


def _entry(state: ServerState) -> dict[str, Any]:
    return {"name": _ollama_name(state), "model": _ollama_name(state),
            "modified_at": _modified(state), "size": file_size(state.llm.path),
            "digest": state.llm.loaded.fingerprint, "details": _details(state)}


async def health(request: Request) -> Response:
    s = _state(request)
    return JSONResponse({"status": "shutting down" if s.closing else "ok",
                         "model": s.model_name}, 503 if s.closing else 200)


async def metrics(request: Request) -> Response:
    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE)


async def models(request: Request) -> Response:
    s = _state(request)
    return JSONResponse({"object": "list", "data": [
        {"id": s.model_name, "object": "model", "created": s.created, "owned_by": "localllm",
         "max_model_len": s.max_model_len}]})


async def model(request: Request) -> Response:
    s = _state(request)
    s.check_model(request.path_params["model"])
    return JSONResponse({"id": s.model_name, "object": "model", "created": s.created,
                         "owned_by": "localllm", "max_model_len": s.max_model_len})


async def tags(request: Request) -> Response:
    return JSONResponse({"models": [_entry(_state(request))]})


async def ps(request: Request) -> Response:
    entry = {**_entry(_state(request)), "expires_at": "9999-12-31T00:00:00Z", "size_vram": 0}
    return JSONResponse({"models": [entry]})


async def show(request: Request) -> Response:
    s = _state(request)
    body = await parse_body(request, ShowRequest)
    s.check_model(body.model or body.name)
    c = s.llm.config
    arch = c.arch
    info = {"general.architecture": arch, "general.name": c.name or s.model_name,
            "general.parameter_count": parameter_count(s.llm.config),
            f"{arch}.context_length": s.max_model_len, f"{arch}.embedding_length": c.hidden_size,
            f"{arch}.block_count": c.num_layers, f"{arch}.attention.head_count": c.num_heads,
            f"{arch}.attention.head_count_kv": c.num_kv_heads}
    capabilities = ["completion"]
    if s.chat_template.takes_tools:
        capabilities.append("tools")
    if s.fim is not None:
        capabilities.append("insert")
    return JSONResponse({"modelfile": f"FROM {s.llm.path}\n", "parameters": "",
                         "template": s.chat_template.source, "details": _details(s),
                         "model_info": info, "capabilities": capabilities,
                         "modified_at": _modified(s)})


def _version() -> str:
    try:
        return importlib_metadata.version("localllm")
    except importlib_metadata.PackageNotFoundError:
        return "0.0.0"


async def version(request: Request) -> Response:
    return JSONResponse({"version": _version()})


async def props(request: Request) -> Response:
    s = _state(request)
    tok = s.llm.tokenizer
    return JSONResponse({
        "default_generation_settings": {"n_ctx": s.max_model_len, "params": {
            **DEFAULTS, "n_predict": -1, "seed": -1}},
        "total_slots": s.llm.engine.scheduler.config.max_num_seqs,
        "model_path": str(s.llm.path), "model_alias": s.model_name, "n_ctx": s.max_model_len,
        "chat_template": s.chat_template.source, "bos_token": tok.bos_token,
        "eos_token": tok.eos_token, "modalities": {"vision": False, "audio": False},
        "infill": s.fim is not None, "build_info": f"localllm {_version()}"})


async def root(request: Request) -> Response:
    return PlainTextResponse("localllm is running")
