"""`localllm bench serve` end to end: against a live `serve` over its Unix socket (engine state
scraped from /metrics), and in-process with a shared prefix; the JSON carries every request's
timeline, the settings and the machine; the plot is a PNG."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from serve_util import ServeProcess, interruptible

from localllm.apps.cli import main

WORKLOAD = ["--num-requests", "6", "--input-len", "24", "--output-len", "8", "--concurrency",
            "3", "--no-progress"]


def test_bench_serve_against_a_live_server(stories_server: ServeProcess, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    out_json, out_png = tmp_path / "run.json", tmp_path / "run.png"
    # 64 tokens each: a run long enough for several 50 ms samples of /metrics
    rc = main(["bench", "serve", "--endpoint", f"unix:{stories_server.socket}", *WORKLOAD,
               "--output-len", "64", "--slo-ttft", "10000", "--slo-e2e", "0.001",
               "--json", str(out_json), "--plot", str(out_png)])
    text = capsys.readouterr().out
    assert rc == 0
    assert "6 completed, 0 failed" in text and "stories260K" in text
    assert "goodput: 0.00 requests/s (0 of 6 met TTFT <= 10000 ms, E2E <= 0.001 ms)" in text
    for row in ("TTFT", "ITL", "TPOT", "E2E"):
        assert any(line.startswith(row) for line in text.splitlines())
    assert "diagnosis: " in text and "engine (" in text

    doc = json.loads(out_json.read_text())
    assert doc["settings"]["endpoint"] == f"unix:{stories_server.socket}"
    assert doc["settings"]["num_requests"] == 6 and doc["settings"]["concurrency"] == 3
    assert doc["machine"]["cores"] and doc["machine"]["cpu"]
    assert doc["machine"]["runs_on"] == f"served at unix:{stories_server.socket}"
    assert doc["summary"]["completed"] == 6 and doc["summary"]["good"] == 0
    assert set(doc["summary"]["ttft"]) == {"mean", "p50", "p90", "p99"}
    assert len(doc["requests"]) == 6
    for r in doc["requests"]:
        assert r["output_tokens"] == 64 and r["finish_reason"] == "length"  # ignore_eos
        assert r["prompt_tokens"] > 0 and r["cached_tokens"] is not None
        assert r["sent_s"] <= r["chunk_times_s"][0] <= r["chunk_times_s"][-1] <= r["finished_s"]
        assert r["ttft_s"] == pytest.approx(r["chunk_times_s"][0] - r["sent_s"])
    # /metrics of the server: KV utilization and running requests over time
    assert doc["samples"] and max(s["running"] for s in doc["samples"]) >= 1
    assert max(s["kv_utilization"] for s in doc["samples"]) > 0
    assert {"kind", "evidence", "advice"} == set(doc["diagnosis"][0])
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_serve_in_process_with_a_shared_prefix(stories_path: Path, tmp_path: Path,
                                                     one_torch_thread: None,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    out_json = tmp_path / "run.json"
    rc = main(["bench", "serve", "--model", str(stories_path), "--dtype", "float32",
               "--threads", "1", *WORKLOAD, "--input-len", "64", "--shared-prefix", "0.5",
               "--output-range", "0.5", "--json", str(out_json)])
    text = capsys.readouterr().out
    assert rc == 0 and "cpu backend on cpu" in text
    doc = json.loads(out_json.read_text())
    reqs = doc["requests"]
    assert all(4 <= r["output_tokens"] <= 12 for r in reqs)  # 8 x [0.5, 1.5]
    # 32 shared tokens: two full 16-token blocks, reused by every request after the first
    # three (sent together, before any block is cached)
    assert all(r["cached_tokens"] == 32 for r in reqs[3:])
    assert doc["summary"]["prefix_hit_rate"] > 0.2
    assert f"prefix cache: {100 * doc['summary']['prefix_hit_rate']:.0f}%" in text
    assert doc["samples"] and "cpu_share" in doc["signals"]  # None in a run under 50 ms
    assert doc["machine"]["backend"] == "cpu" and doc["machine"]["device"] == "cpu"


def test_ctrl_c_reports_what_was_measured(stories_path: Path) -> None:
    import os
    import re
    import signal
    import subprocess
    import sys
    import time

    proc = subprocess.Popen(
        [sys.executable, "-m", "localllm.apps.cli", "bench", "serve", "--model", str(stories_path),
         "--dtype", "float32", "--threads", "1", "--num-requests", "500", "--input-len", "16",
         "--output-len", "32", "--concurrency", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"}, preexec_fn=interruptible)
    assert proc.stderr is not None
    seen = ""
    deadline = time.monotonic() + 60
    while not re.search(r"\b[1-9]\d*/500\b", seen):  # the progress bar: some are done
        assert time.monotonic() < deadline and proc.poll() is None, seen
        seen += os.read(proc.stderr.fileno(), 4096).decode()
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert "(interrupted: what was measured so far)" in out
    m = re.search(r"(\d+) completed, 0 failed", out)
    assert m and 0 < int(m.group(1)) < 500
    assert any(line.startswith("TTFT") for line in out.splitlines())
