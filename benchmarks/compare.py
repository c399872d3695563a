"""localllm beside llama.cpp and transformers on one model, in one run, in one table.

    python benchmarks/compare.py [--model PATH] [--threads 2] [--prompt-tokens 512]
        [--decode-tokens 128] [--repeat 2] [--no-transformers] [--requests 16]
        [--concurrency 4] [--input-len 256] [--output-len 64] [--json OUT]

latency (batch 1, as `benchmarks/bench_cpu.py` measures it, each system in its own process):
prompt processing tokens/s of one --prompt-tokens prompt, and generation tokens/s of
--decode-tokens greedy steps, best of --repeat after a warm-up; localllm, llama.cpp
(llama-cpp-python) and transformers bf16.

serve: one `localllm bench serve` workload (--requests prompts of --input-len tokens written to
a JSONL file first, so every system gets the same text; --output-len tokens each, at most
--concurrency open at once) through localllm in-process, `localllm serve` on its Unix socket,
and `python -m llama_cpp.server` on loopback TCP (`min_tokens` keeps it generating to length,
as ignore_eos does for localllm). Each server runs alone. The on-disk prefix store is off.

The table's last column divides localllm's figure by the row's (for latencies, the row's by
localllm's), so above 1 means localllm is better. Results go to benchmarks/results/ (or --json)
with the machine's description.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_cpu import bench_llama_cpp, bench_localllm, bench_transformers  # noqa: E402
from bench_serve import start_llama, stop, wait_ready  # noqa: E402
from llama_ref import in_child  # noqa: E402

from localllm.machine import describe  # noqa: E402
from localllm.model_path import resolve_model  # noqa: E402

ENV = {**os.environ, "LOCALLLM_PREFIX_CACHE": "0"}
CLI = [sys.executable, "-m", "localllm.apps.cli"]


def localllm_latency(threads: int, *args: Any) -> dict[str, Any]:
    import torch

    torch.set_num_threads(threads)
    return bench_localllm(*args)


def write_dataset(path: Path, model: Path, args: argparse.Namespace) -> None:
    """The serve workload's prompts, counted with the model's own tokenizer."""
    import numpy as np

    from localllm.apps.bench_serve_workload import synthetic
    from localllm.client import Client
    from localllm.gguf.reader import GGUFFile
    from localllm.text.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf_metadata(GGUFFile(model).metadata)

    class Counter(Client):  # only count_tokens is used
        async def count_tokens(self, text: str) -> int:
            return len(tok.encode(text, add_special=False))

        stream_chat = stream_text = aclose = None  # type: ignore[assignment]

    n = args.requests
    specs = asyncio.run(synthetic(Counter(), n, [args.input_len] * n, [args.output_len] * n, 0.0,
                                  np.random.default_rng(0)))
    path.write_text("".join(json.dumps({"prompt": s.prompt, "output_len": s.output_len}) + "\n"
                            for s in specs))


def bench_serve(extra: list[str], dataset: Path, args: argparse.Namespace) -> dict[str, Any]:
    out = Path(tempfile.mkdtemp()) / "run.json"
    cmd = [*CLI, "bench", "serve", "--dataset", str(dataset), "--num-requests",
           str(args.requests), "--concurrency", str(args.concurrency), "--no-progress",
           "--json", str(out), *extra]
    subprocess.run(cmd, env=ENV, check=True, stdout=sys.stderr)
    doc: dict[str, Any] = json.loads(out.read_text())
    return doc


def serve_localllm_socket(model: Path, dataset: Path, args: argparse.Namespace
                          ) -> dict[str, Any]:
    sock = Path(tempfile.mkdtemp()) / "s.sock"
    proc = subprocess.Popen([*CLI, "serve", "--model", str(model), "--threads",
                             str(args.threads), "--socket", str(sock), "--max-model-len",
                             str(args.ctx)], env=ENV, stderr=subprocess.DEVNULL)
    try:
        unix = httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://x")
        wait_ready(proc, lambda: unix.get("/health").status_code == 200)
        return bench_serve(["--endpoint", f"unix:{sock}"], dataset, args)
    finally:
        stop(proc)


def serve_llama(model: Path, dataset: Path, args: argparse.Namespace) -> dict[str, Any]:
    proc, base = start_llama(model, args.threads, args.ctx)
    try:
        return bench_serve(["--endpoint", base, "--extra-body",
                            json.dumps({"min_tokens": args.output_len})], dataset, args)
    finally:
        stop(proc)


def _fmt(v: float | None, digits: int) -> str:
    return "" if v is None else f"{v:,.{digits}f}"


def table(latency: dict[str, dict[str, float]], serve: dict[str, dict[str, Any]],
          args: argparse.Namespace) -> str:
    rows = ["| workload | system | tokens/s | TTFT p50 (ms) | ITL p50 (ms) | E2E p50 (ms) | "
            "localllm ÷ this (tokens/s) |", "|---|---|---:|---:|---:|---:|---:|"]
    for key, name in (("prefill_tok_s", f"latency pp{args.prompt_tokens}"),
                      ("decode_tok_s", f"latency tg{args.decode_tokens}")):
        ours = latency["localllm"][key]
        for system, r in latency.items():
            rows.append(f"| {name} | {system} | {r[key]:,.1f} | | | | "
                        f"{ours / r[key]:.2f}x |")
    name = (f"serve {args.requests} x {args.input_len}+{args.output_len}, "
            f"concurrency {args.concurrency}")
    ours_rate = serve["localllm serve (socket)"]["summary"]["output_throughput"]
    for system, doc in serve.items():
        s = doc["summary"]
        ms = {k: 1000 * s[k]["p50"] if s[k] else None for k in ("ttft", "itl", "e2e")}
        rows.append(f"| {name} | {system} | {s['output_throughput']:,.1f} | "
                    f"{_fmt(ms['ttft'], 0)} | {_fmt(ms['itl'], 1)} | {_fmt(ms['e2e'], 0)} | "
                    f"{ours_rate / s['output_throughput']:.2f}x |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--json", type=Path, default=None,
                    help="default: benchmarks/results/compare_<cores>core.json")
    args = ap.parse_args()
    model = resolve_model(args.model)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"latency: localllm, llama.cpp{'' if args.no_transformers else ', transformers'}",
          file=sys.stderr)
    latency = {"localllm": in_child(localllm_latency, args.threads, model, "bfloat16",
                                    args.prompt_tokens, args.decode_tokens, args.repeat)}
    ids = latency["localllm"].pop("ids")
    latency["llama.cpp"] = in_child(bench_llama_cpp, model, args.threads, args.prompt_tokens,
                                    args.decode_tokens, args.repeat, ids)
    if not args.no_transformers:
        latency["transformers bf16"] = in_child(bench_transformers, model, args.threads,
                                                args.prompt_tokens, args.decode_tokens,
                                                args.repeat, ids)
    dataset = Path(tempfile.mkdtemp()) / "prompts.jsonl"
    write_dataset(dataset, model, args)
    serve: dict[str, dict[str, Any]] = {}
    print("serve: localllm serve (socket)", file=sys.stderr)
    serve["localllm serve (socket)"] = serve_localllm_socket(model, dataset, args)
    print("serve: localllm in-process", file=sys.stderr)
    serve["localllm in-process"] = bench_serve(
        ["--model", str(model), "--threads", str(args.threads), "--max-model-len",
         str(args.ctx)], dataset, args)
    print("serve: llama_cpp.server", file=sys.stderr)
    serve["llama_cpp.server"] = serve_llama(model, dataset, args)
    text = table(latency, serve, args)
    print(text)
    import torch

    desc = describe("cpu", torch.device("cpu")) | {"threads": args.threads}
    out = args.json or ROOT / "benchmarks" / "results" / f"compare_{desc['cores']}core.json"
    import llama_cpp

    out.write_text(json.dumps({
        "started": started, "machine": desc, "llama_cpp_python": llama_cpp.__version__,
        "model": model.name, "settings": vars(args) | {"json": str(out.name), "model": model.name},
        "latency": latency,
        "serve": {k: {"summary": v["summary"], "engine": v["engine"],
                      "signals": v["signals"], "diagnosis": v["diagnosis"],
                      "backend": v["machine"]["backend"]}
                  for k, v in serve.items()},
        "table": text}, indent=1) + "\n")
    print(f"[results: {out}]", file=sys.stderr)


if __name__ == "__main__":
    main()
