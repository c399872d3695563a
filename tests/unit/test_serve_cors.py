"""`--cors-origin`: a browser's preflight from a named origin is answered (without the API key,
which a preflight never carries), the request it clears still needs the key over TCP, other
origins get no CORS headers, and without the option OPTIONS stays refused."""

from __future__ import annotations

from pathlib import Path

from gguf_factory import write_model
from scripted_server import ScriptedEngine
from starlette.testclient import TestClient

from localllm import LLM
from localllm.server.app import build_app
from localllm.server.state import ServeOptions, ServerState

SITE = "http://localhost:3000"
PREFLIGHT = {"Origin": SITE, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}


def app(tmp_path: Path, origins: tuple[str, ...]) -> TestClient:
    write_model(tmp_path / "tiny.gguf")
    llm = LLM(tmp_path / "tiny.gguf", dtype="float32")
    state = ServerState(llm, ScriptedEngine(llm), "tiny",
                        ServeOptions(api_key="k", cors_origins=origins))
    return TestClient(build_app(state))  # its requests arrive as TCP ones


def test_a_named_origin(tmp_path: Path) -> None:
    with app(tmp_path, (SITE,)) as c:
        pre = c.options("/v1/completions", headers=PREFLIGHT)
        assert pre.status_code == 200
        assert pre.headers["access-control-allow-origin"] == SITE
        assert "authorization" in pre.headers["access-control-allow-headers"].lower()
        body = {"prompt": "hello", "max_tokens": 4}
        assert c.post("/v1/completions", json=body, headers={"Origin": SITE}).status_code == 401
        ok = c.post("/v1/completions", json=body,
                    headers={"Origin": SITE, "Authorization": "Bearer k"})
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "Hello there."
        assert ok.headers["access-control-allow-origin"] == SITE
        other = c.options("/v1/completions", headers={**PREFLIGHT, "Origin": "http://evil.test"})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers


def test_without_the_option(tmp_path: Path) -> None:
    with app(tmp_path, ()) as c:
        pre = c.options("/v1/completions", headers=PREFLIGHT)
        assert pre.status_code in (401, 405) and "access-control-allow-origin" not in pre.headers
