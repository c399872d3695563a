"""llama-server's `/completion`, `/infill` and `/props` over a scripted engine: the answer's
fields and `response_fields`, streams without [DONE], `samplers`, `n_predict` 0, the FIM prompt
with extra context within the context, `n_indent` and `t_max_predict_ms`, and what is
refused."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fim_model import write_fim_model
from gguf_factory import write_model
from scripted_server import ScriptedEngine, client, running

from localllm import LLM
from localllm.server.state import ServerState
from localllm.text.fim import ExtraFile, FimTokens, infill_prompt

CONTEXT = 512


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[Path, ScriptedEngine, FimTokens, LLM]]:
    d = tmp_path_factory.mktemp("llamacpp")
    fim = write_fim_model(d / "fim.gguf", repo=True, context=CONTEXT)
    llm = LLM(d / "fim.gguf", dtype="float32")
    engine = ScriptedEngine(llm)
    with running(ServerState(llm, engine, "fim", fim=fim), d / "s.sock"):
        yield d / "s.sock", engine, fim, llm


def sse(r: httpx.Response) -> list[dict[str, Any]]:
    lines = [x.removeprefix("data: ") for x in r.iter_lines() if x.startswith("data: ")]
    assert "[DONE]" not in lines  # llama-server's own routes send none
    return [json.loads(x) for x in lines]


def test_completion_answer(served: Any) -> None:
    path, engine, _, llm = served
    with client(path) as c:
        r = c.post("/completion", json={"prompt": "hello", "n_predict": 8}).json()
        picked = c.post("/completion", json={
            "prompt": "hello", "response_fields": ["content", "timings/predicted_n", "nope"]}
        ).json()
        ids = c.post("/completion", json={"prompt": [7, 8, 9]}).json()
        many = c.post("/completion", json={"prompt": ["hello", [7, 8]]}).json()
        mixed = c.post("/completion", json={"prompt": ["he", 7, "llo"]}).json()
        one = c.post("/completion", json={"prompt": ["hello"]}).json()
        control = c.post("/completion", json={"prompt": "<|fim_prefix|>a<|fim_middle|>"}).json()
        nulls = c.post("/completion", json={"prompt": "hello", "temperature": None,
                                            "stop": None, "seed": None})
    assert r["content"] == "Hello there." and r["stop"] is True
    assert r["tokens_predicted"] == 3 and r["tokens_evaluated"] == len(llm.encode("hello"))
    assert r["model"] == "fim" and r["truncated"] is False and r["has_new_line"] is False
    assert r["timings"]["predicted_n"] == 3 and r["timings"]["prompt_n"] == r["tokens_evaluated"]
    assert r["generation_settings"]["temperature"] == 0.8
    assert r["generation_settings"]["n_predict"] == 8 and engine.params[0].max_tokens == 8
    assert picked == {"content": "Hello there.", "timings/predicted_n": 3}
    bos = [llm.tokenizer.bos_id] if llm.tokenizer.add_bos else []
    # token ids are used as sent; a mixed list starting with text gets the BOS, as llama-server
    assert ids["tokens_evaluated"] == 3 and engine.prompts[2] == [7, 8, 9]
    assert [(x["index"], x["content"]) for x in many] == [(0, "Hello there."), (1, "Hello there.")]
    tok = llm.tokenizer
    assert engine.prompts[5] == [*bos, *tok.encode("he", add_special=False), 7,
                                 *tok.encode("llo", add_special=False)]
    assert mixed["tokens_evaluated"] == len(engine.prompts[5])
    assert isinstance(one, dict) and one["content"] == "Hello there."  # one prompt: an object
    # the prompt is raw: control-token text is the token (a script writes its own template)
    fim = served[2]
    assert engine.prompts[7] == [*bos, fim.prefix, *tok.encode("a", add_special=False),
                                 fim.middle]
    assert control["tokens_evaluated"] == len(bos) + 3
    assert nulls.status_code == 200 and engine.params[-1].temperature == 0.8  # null: default


def test_streamed(served: Any) -> None:
    with client(served[0]) as c:
        events = sse(c.post("/completion", json={"prompt": "hello", "stream": True}))
        picked = sse(c.post("/completion", json={"prompt": "indented", "stream": True,
                                                 "n_indent": 4,
                                                 "response_fields": ["stop", "stop_type"]}))
    assert "".join(e["content"] for e in events) == "Hello there."
    assert [e["stop"] for e in events] == [False] * (len(events) - 1) + [True]
    assert events[-1]["tokens_predicted"] == 3 and "timings" in events[-1]
    assert events[-1]["content"] == ""  # all text comes in the partial events
    # response_fields picks from the last event only: no text is lost with it
    assert "".join(e.get("content", "") for e in picked) == "x = 1\n    y = 2\n    z = 3\n"
    assert picked[-1] == {"stop": True, "stop_type": "limit"}


@pytest.mark.parametrize(("fields", "expected"), [
    ({}, (0.8, 40, 0.95, 0.05)),
    ({"samplers": ["top_k", "top_p", "infill"], "top_k": 20, "top_p": 0.99},
     (1.0, 20, 0.99, 0.0)),
    ({"samplers": "mt", "temperature": 0.5}, (0.5, 0, 1.0, 0.05)),
    ({"samplers": ["top_k"], "temperature": 0}, (0.0, 40, 1.0, 0.0)),
])
def test_samplers(served: Any, fields: dict[str, Any],
                  expected: tuple[float, int, float, float]) -> None:
    path, engine, _, _ = served
    with client(path) as c:
        assert c.post("/completion", json={"prompt": "hello", **fields}).status_code == 200
    p = engine.params[-1]
    assert (p.temperature, p.top_k, p.top_p, p.min_p) == expected


def test_fields_refused_and_ignored(served: Any) -> None:
    with client(served[0]) as c:
        bad = c.post("/completion", json={"prompt": "hello", "mirostat": 2})
        neutral = c.post("/completion", json={"prompt": "hello", "grammar": "", "n_probs": 0,
                                              "id_slot": 3, "cache_prompt": True, "other": 1})
        empty = c.post("/completion", json={"n_predict": 4})
        wrong = c.post("/completion", json={"prompt": "hello", "n_predict": "4"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "mirostat"
    assert "mirostat is not supported" in bad.json()["error"]["message"]
    assert neutral.status_code == 200
    assert empty.status_code == 400 and "prompt is required" in empty.json()["error"]["message"]
    assert wrong.status_code == 400 and "n_predict" in wrong.json()["error"]["message"]


def test_n_predict_0_only_prefills(served: Any) -> None:
    path, engine, _, _ = served
    with client(path) as c:
        r = c.post("/infill", json={"input_prefix": "a", "n_predict": 0,
                                    "input_extra": [{"filename": "x.py", "text": "y = 2\n"}]})
    assert r.status_code == 200
    assert r.json()["content"] == "" and r.json()["tokens_predicted"] == 0
    assert r.json()["stop_type"] == "limit" and engine.params[-1].max_tokens == 1


def test_infill_prompt_and_budget(served: Any) -> None:
    path, engine, fim, llm = served
    extra = [{"filename": f"f{i}.py", "text": "word " * 40, "time": 1} for i in range(6)]
    body = {"input_prefix": "def f(a):\n", "input_suffix": "\n    return b\n",
            "prompt": "    b = ", "n_predict": 32}
    with client(path) as c:
        alone = c.post("/infill", json=body).json()
        full = c.post("/infill", json={**body, "input_extra": extra[:1]}).json()
        cut = c.post("/infill", json={**body, "input_extra": extra}).json()
    ids = infill_prompt(llm.tokenizer, fim, "def f(a):\n", "\n    return b\n", "    b = ").ids
    assert engine.prompts[-3] == ids and alone["truncated"] is False
    assert engine.params[-3].stop_token_ids == (fim.repo, fim.file_sep)
    assert engine.prompts[-2] == infill_prompt(
        llm.tokenizer, fim, "def f(a):\n", "\n    return b\n", "    b = ",
        [ExtraFile("f0.py", "word " * 40)]).ids
    assert full["truncated"] is False
    # six files do not fit a 512-token context with its eighth kept for the answer: the oldest
    # are left out, and the answer says so
    kept = len(engine.prompts[-1])
    assert cut["truncated"] is True and kept <= CONTEXT - CONTEXT // 8
    assert engine.prompts[-1][-len(ids) + 1:] == ids[1:]
    # a warm-up (n_predict 0, no text of its own) keeps the same files as the completion
    with client(path) as c:
        warm = c.post("/infill", json={"input_extra": extra, "n_predict": 0}).json()
    assert warm["truncated"] is True
    header = engine.prompts[-1][:-3]  # all but <fim_prefix><fim_suffix><fim_middle>
    assert engine.prompts[-2][:len(header)] == header


def test_n_indent_and_time_limit(served: Any) -> None:
    path, engine, _, _ = served
    aborted = len(engine.aborted)
    with client(path) as c:
        r = c.post("/infill", json={"input_prefix": "indented", "n_indent": 4}).json()
        streamed = sse(c.post("/infill", json={"input_prefix": "indented", "n_indent": 4,
                                               "stream": True}))
        timed = c.post("/infill", json={"input_prefix": "newlines",
                                        "t_max_predict_ms": 50}).json()
    assert r["content"] == "x = 1\n    y = 2\n    z = 3\n" and r["stop_type"] == "limit"
    assert "".join(e["content"] for e in streamed) == r["content"]
    assert timed["stop_type"] == "limit" and timed["content"].endswith("\n")
    assert timed["timings"]["predicted_ms"] >= 50
    assert len(engine.aborted) == aborted + 3  # a request a rule ended is stopped in the engine


def test_infill_needs_fim_tokens(tmp_path: Path) -> None:
    write_model(tmp_path / "plain.gguf")
    llm = LLM(tmp_path / "plain.gguf", dtype="float32")
    with running(ServerState(llm, ScriptedEngine(llm), "plain"), tmp_path / "s.sock"), \
            client(tmp_path / "s.sock") as c:
        r = c.post("/infill", json={"input_prefix": "a", "input_suffix": "b"})
    assert r.status_code == 400
    assert "has no fill-in-the-middle tokens" in r.json()["error"]["message"]
    assert "/infill cannot be used" in r.json()["error"]["message"]
    assert "without a suffix" not in r.json()["error"]["message"]


def test_props(served: Any) -> None:
    path, _, _, llm = served
    with client(path) as c:
        p = c.get("/props").json()
    assert p["n_ctx"] == p["default_generation_settings"]["n_ctx"] == CONTEXT
    assert p["default_generation_settings"]["params"]["temperature"] == 0.8
    assert p["model_alias"] == "fim" and p["model_path"] == str(llm.path)
    assert p["infill"] is True and p["total_slots"] >= 1
    assert p["chat_template"] == llm.template.source
