"""`localllm bench latency`: the statistics, the synthetic steps against teacher-forced logits,
every output format with the machine / model / settings fields, Ctrl-C and bad input."""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf_factory import ModelSpec, write_model

from localllm.apps import bench_latency
from localllm.apps.cli import main as cli_main
from localllm.engine.latency import LatencyRunner
from localllm.engine.metrics import mean_sd
from localllm.engine.model_runner import ModelRunner, prompt_logits
from localllm.loader import load_gguf

ROOT = Path(__file__).resolve().parents[2]
STORIES = ROOT.parent / "shared" / "models" / "stories260K.gguf"
needs_stories = pytest.mark.skipif(not STORIES.exists(),
                                   reason="../shared/models/stories260K.gguf is absent")
ARGS = ["bench", "latency", "-m", str(STORIES), "-p", "16", "-n", "4", "-r", "2", "-b", "1,2",
        "-d", "0,16"]


def test_mean_sd_by_hand() -> None:
    # mean 40 / 8 = 5; squared deviations 9+1+1+1+0+0+4+16 = 32; sample sd sqrt(32 / 7)
    mean, sd = mean_sd([2, 4, 4, 4, 5, 5, 7, 9])
    assert mean == 5
    assert sd == pytest.approx(math.sqrt(32 / 7))
    assert mean_sd([3.5]) == (3.5, 0.0)
    assert mean_sd([1.0, 3.0]) == (2.0, pytest.approx(math.sqrt(2)))


class Recording(LatencyRunner):
    def token_ids(self, n: int) -> torch.Tensor:
        ids = super().token_ids(n)
        self.drawn.append(ids)
        return ids


def test_synthetic_steps_attend_to_their_own_sequence(tmp_path: Path) -> None:
    """Two sequences, a depth filled in chunks, a prompt prefilled in steps that mix both
    sequences: each sequence's last logits equal teacher-forced logits of its own tokens."""
    path = tmp_path / "m.gguf"
    write_model(path, ModelSpec(hidden=64, ffn=128, heads=4, kv_heads=2, layers=2,
                                qtype=QT.Q4_0))
    model = load_gguf(path, torch.float32).model
    runner = ModelRunner(model, 2 * 3, 16)
    lr = Recording(runner, max_batch=2, max_len=48, step_tokens=24)
    lr.drawn = []
    seqs: list[list[int]] = [[], []]
    plan = lr._plan(0, 30, 2) + lr._plan(30, 42, 2)
    assert any(len(step) == 2 for step in plan)  # a step holding both sequences
    rows = []
    for chunks in plan:
        out = lr._step(chunks, 42)
        ids = lr.drawn[-1].tolist()
        for i, s, e in chunks:
            seqs[i] += ids[:e - s]
            ids = ids[e - s:]
        if out is not None:
            rows.append(out)
    logits = torch.cat(rows)  # [2, vocab]: sequence 0, then 1
    for i in (0, 1):
        assert len(seqs[i]) == 42
        ref = prompt_logits(model, seqs[i])[-1]
        torch.testing.assert_close(logits[i].cpu(), ref, rtol=1e-4, atol=1e-4)


def _check_record(r: dict, n: int) -> None:
    for key in ("cpu", "cores", "threads", "backend", "device", "native_kernels", "gpu"):
        assert key in r["machine"]
    assert r["machine"]["backend"] == "cpu" and r["machine"]["cores"] >= 1
    assert r["model"]["file"] == "stories260K.gguf" and r["model"]["quant"] == "F32"
    assert r["model"]["params"] == 292800
    s = r["settings"]
    assert (s["n_prompt"], s["n_gen"], s["repetitions"], s["batch_sizes"], s["depths"]) == (
        16, 4, 2, [1, 2], [0, 16])
    samples = r["tokens_per_s_samples"]
    assert len(samples) == 2 and all(v > 0 for v in samples)
    assert (r["tokens_per_s"], r["tokens_per_s_sd"]) == pytest.approx(mean_sd(samples))
    if r["test"] == "pp16":
        assert r["tokens"] == 16 * r["batch"] and r["ttft_ms"] > r["sample_ms"] > 0
        assert "tokenize_ms" in r
    else:
        assert r["test"] == "tg4" and r["tokens"] == 4 * r["batch"]
        assert r["itl_p99_ms"] >= r["itl_p50_ms"] > 0 and len(r["sample_ms_samples"]) == 8


@needs_stories
def test_json_and_jsonl_carry_every_field(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main([*ARGS, "-o", "json"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert [(r["test"], r["batch"], r["depth"]) for r in records] == [
        (t, b, d) for d in (0, 16) for b in (1, 2) for t in ("pp16", "tg4")]
    for r in records:
        _check_record(r, 2)
    assert cli_main([*ARGS, "-b", "1", "-d", "0", "-o", "jsonl"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2
    for line in lines:
        r = json.loads(line)
        assert r["batch"] == 1 and r["machine"]["cpu"]


@needs_stories
def test_csv_md_and_table(capsys: pytest.CaptureFixture[str]) -> None:
    one = [*ARGS, "-b", "2", "-d", "16"]
    assert cli_main([*one, "-o", "csv"]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert [r["test"] for r in rows] == ["pp16", "tg4"]
    for r in rows:
        assert r["machine.cpu"] and r["model.quant"] == "F32" and r["settings.backend"] == "cpu"
        assert r["settings.batch_sizes"] == "2" and float(r["tokens_per_s"]) > 0
    for fmt in ("md", "table"):
        assert cli_main([*one, "-o", fmt]) == 0
        out = capsys.readouterr().out.splitlines()
        assert out[0].startswith("machine: ") and "native kernels" in out[0]
        body = [line for line in out if "stories260K.gguf" in line]
        assert len(body) == 2 and "pp16" in body[0] and "tg4" in body[1]
        assert " ± " in body[0]
        if fmt == "md":
            assert all(line.startswith("| ") for line in body)
            assert out[out.index(body[0]) - 1].startswith("|--")


@needs_stories
def test_ctrl_c_prints_what_was_measured(monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    def interrupted(self: LatencyRunner, depth: int, n: int, batch: int) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(LatencyRunner, "generate", interrupted)
    assert cli_main([*ARGS, "-o", "jsonl"]) == 130
    captured = capsys.readouterr()
    assert [json.loads(line)["test"] for line in captured.out.splitlines()] == ["pp16"]
    assert "interrupted: 1 measurement(s) shown" in captured.err


@needs_stories
def test_pool_sized_for_the_runs_gives_no_kv_warning(caplog: pytest.LogCaptureFixture,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    # the pool holds the runs' longest sequence (2 x 32 tokens), far less than the model's
    # 2048-token context; a warning to raise --kv-cache-memory (ignored here) would mislead
    assert cli_main([*ARGS, "-o", "jsonl"]) == 0
    assert "KV cache holds" not in caplog.text
    assert "KV cache holds" not in capsys.readouterr().err


@needs_stories
def test_bad_input(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    with monkeypatch.context() as m:  # a depth past the context is refused before loading
        m.setattr("localllm.llm.LLM", lambda *a, **k: pytest.fail("loaded the model"))
        assert cli_main([*ARGS, "-d", "4096"]) == 2
    assert "exceed the model's context of 2048; lower -d, -p or -n" in capsys.readouterr().err
    assert cli_main([*ARGS, "-p", "0", "-n", "0"]) == 2
    assert "one of them positive" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main([*ARGS, "-b", "1,x"])
    assert "whole numbers separated by commas" in capsys.readouterr().err
    assert bench_latency.format_records([], "json") == "[]"
