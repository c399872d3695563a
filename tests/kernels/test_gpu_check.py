"""benchmarks/gpu_check.py's CPU check: with --tiny it times every kernel family at tiny shapes
(under TRITON_INTERPRET=1 without a GPU) and runs the engine on a tiny synthetic int4 model,
and writes its JSON, so the script a GPU machine runs is exercised here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]


def test_tiny_run_writes_every_section(tmp_path: Path) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", OUT=str(tmp_path))
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--tiny"],
                       env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["copy_GBps"] > 0
    kinds = {(r["matrix"], r["M"]) for r in report["matmul"]}
    assert kinds == {(m, rows) for m in ("qkv", "o", "gate_up", "down") for rows in (1, 8)}
    assert all(r["int4_ms"] > 0 and r["fp16_ms"] > 0 for r in report["matmul"])
    ops = [(r["op"], r["batch"]) for r in report["attention"]]
    assert ops == [("decode", 1), ("decode", 8), ("extend", 1)]
    assert "int4 ms" in p.stdout and "paged ms" in p.stdout
    from localllm.model_path import default_model_path

    if default_model_path() is not None:  # the end-to-end part, on a tiny synthetic model
        (row,) = report["engine"]
        assert row["decode_tok_s@1"] > 0 and row["decode_tok_s@8"] > 0 and row["ttft_ms"] > 0
