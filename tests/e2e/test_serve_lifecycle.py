"""A live `localllm serve` from start to SIGTERM: the default socket in a private runtime
directory (a stale socket there replaced, a live one never taken), mode 0600, the startup lines,
fill-in-the-middle on a tiny model whose vocabulary has FIM tokens, and a clean stop."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import threading
from pathlib import Path

import pytest
from fim_model import write_fim_model
from serve_util import ServeProcess

from localllm import LLM, SamplingParams
from localllm.apps.cli import main
from localllm.text.fim import fim_prompt


def test_serve_from_start_to_sigterm(tmp_path: Path) -> None:
    model = tmp_path / "fim.gguf"
    fim = write_fim_model(model, context=1024)
    runtime = tmp_path / "run"
    private = runtime / "localllm"
    private.mkdir(parents=True)
    os.chmod(runtime, 0o700)  # as XDG requires of $XDG_RUNTIME_DIR
    os.chmod(private, 0o755)  # too open: serve makes it private
    sock_path = private / "localllm.sock"
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(sock_path))  # a socket file nobody listens on, as a killed server leaves
    stale.close()
    env = {"XDG_RUNTIME_DIR": str(runtime)}
    server = ServeProcess.start(["--model", str(model), "--dtype", "float32", "--threads", "1",
                                 "--shutdown-timeout", "1"], None, env)
    server.socket = sock_path
    try:
        assert f"listening on unix:{sock_path}" in server.output
        assert "replacing" in server.output and "ready: fim" in server.output
        assert "fill-in-the-middle" in server.output
        assert stat.S_IMODE(os.stat(sock_path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(private).st_mode) == 0o700

        # a second server on the same socket fails at once, before loading a model
        second = ServeProcess.start(["--model", str(model)], None, env, wait_ready=False)
        assert second.wait(30) == 2
        assert "another localllm serve (pid" in second.output and "loading" not in second.output

        # fill-in-the-middle: the prompt is built from the FIM tokens, greedy text as in-process
        llm = LLM(model, dtype="float32")
        ids = fim_prompt(llm.tokenizer, fim, "def add(a, b):", "\n    return c")
        assert ids[-1] == fim.middle and fim.prefix in ids and fim.suffix in ids
        expected = llm.generate([ids], SamplingParams(max_tokens=6, temperature=0,
                                                      ignore_eos=True))[0]
        with server.http() as c:
            r = c.post("/v1/completions", json={
                "prompt": "def add(a, b):", "suffix": "\n    return c", "max_tokens": 6,
                "temperature": 0, "ignore_eos": True}).json()
            assert r["usage"]["prompt_tokens"] == len(ids)
            assert r["choices"][0]["text"] == expected.text
            o = c.post("/api/generate", json={
                "prompt": "def add(a, b):", "suffix": "\n    return c", "stream": False,
                "raw": True, "options": {"temperature": 0, "num_predict": 6}}).json()
            assert o["context"][:len(ids)] == ids
            assert "insert" in c.post("/api/show", json={"model": "fim"}).json()["capabilities"]
            # llama-server's /infill (llama.vim's request) and /completion: the same text
            infill = c.post("/infill", json={
                "input_prefix": "def add(a, b):", "input_suffix": "\n    return c",
                "input_extra": [], "prompt": "", "n_predict": 6, "temperature": 0,
                "ignore_eos": True, "samplers": ["top_k", "top_p", "infill"],
                "cache_prompt": True, "t_max_prompt_ms": 500, "response_fields": [
                    "content", "timings/prompt_n", "timings/cache_n", "truncated"]}).json()
            # the same prompt went in before: its whole blocks come from the prefix cache
            cached = (len(ids) - 1) // 16 * 16
            assert cached > 0
            assert infill == {"content": expected.text, "timings/prompt_n": len(ids) - cached,
                              "timings/cache_n": cached, "truncated": False}
            # llama.vim's flow: extra context sent ahead with n_predict 0 fills the prefix
            # cache; the completion after it reads those blocks from there
            extra = [{"filename": "util.py", "text": "def sub(a, b):\n    return a - b\n" * 3}]
            warm = c.post("/infill", json={"input_extra": extra, "n_predict": 0}).json()
            assert warm["content"] == "" and warm["timings"]["cache_n"] == 0
            hole = {"input_prefix": "def mul(a, b):", "input_suffix": "\n", "n_predict": 4,
                    "input_extra": extra, "temperature": 0}
            used = c.post("/infill", json=hole).json()
            shared = warm["tokens_evaluated"] - 2  # all but <fim_suffix><fim_middle>
            assert used["timings"]["cache_n"] == shared // 16 * 16 > 0
            assert used["tokens_cached"] == used["tokens_evaluated"] + used["tokens_predicted"]
            plain = llm.generate([llm.encode("hello")], SamplingParams(
                max_tokens=5, temperature=0, ignore_eos=True))[0]
            done = c.post("/completion", json={"prompt": "hello", "n_predict": 5,
                                               "temperature": 0, "ignore_eos": True}).json()
            assert done["content"] == plain.text and done["stop_type"] == "limit"
            assert done["tokens_predicted"] == 5

        # SIGTERM while a stream is open: it still ends properly, the socket file goes
        lines: list[str] = []
        started = threading.Event()

        def read() -> None:
            body = {"prompt": "hello", "max_tokens": 200, "temperature": 0, "ignore_eos": True,
                    "stream": True}
            with server.http() as c, c.stream("POST", "/v1/completions", json=body) as resp:
                for line in resp.iter_lines():
                    lines.append(line)
                    started.set()

        reader = threading.Thread(target=read)
        reader.start()
        assert started.wait(30)
        assert server.stop(signal.SIGTERM) == 0
        reader.join(30)
        events = [x.removeprefix("data: ") for x in lines if x.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["choices"][0]["finish_reason"] in ("length", "abort")
        assert not sock_path.exists()
        assert "stopped" in server.output
    finally:
        server.kill()


@pytest.mark.parametrize(("args", "message"), [
    (["--port", "0"], "TCP needs an API key"),
    (["--host", "0.0.0.0", "--port", "0", "--api-key", "k"], "not a loopback address"),
    (["--chat-template", "/nonexistent/t.jinja"], "--chat-template"),
])
def test_refused_before_loading(args: list[str], message: str, tmp_path: Path,
                                capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["serve", "--socket", str(tmp_path / "s.sock"), *args])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and "loading" not in err
    assert not (tmp_path / "s.sock").exists()


def test_a_file_in_the_sockets_place_is_kept(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "s.sock"
    path.write_text("mine")
    assert main(["serve", "--socket", str(path)]) == 2
    assert "exists and is not a socket" in capsys.readouterr().err
    assert path.read_text() == "mine"
