"""Serving latency: `localllm serve` beside llama-cpp-python's server, same model, one run.

    python benchmarks/bench_serve.py [--model PATH] [--threads 2] [--max-tokens 64]
                                     [--rounds 2] [--clients 1 4 8] [--json OUT]

Each server runs alone (started, measured, stopped, then the next): `localllm serve` on its Unix
socket and on loopback TCP, then `python -m llama_cpp.server` on loopback TCP (it has no Unix
socket), with the same thread count and context. For each level N, `--rounds` rounds of N
concurrent streaming clients each send one greedy `/v1/completions` request (a different prompt
per client, `--max-tokens` tokens, end-of-text suppressed so every stream runs to length:
`ignore_eos` for localllm, a -100 logit bias on the end tokens for llama.cpp). Reported: time to
first token (TTFT) and inter-token latency (ITL, the gaps between streamed chunks) at p50 and
p99, and aggregate tokens/s (all streamed tokens of a round over its wall time, averaged over
rounds). llama-cpp-python's server runs one request at a time (`--interrupt_requests False`
queues the others instead of cancelling them); its extra CPU buffer types are turned off as in
tests/llama_ref.py (they crash on this project's AVX-512/AMX machines). Every request has a
timeout and the servers are stopped at the end, whatever happens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from localllm.engine.metrics import percentile  # noqa: E402
from localllm.machine import cpu_model  # noqa: E402
from localllm.model_path import find_model  # noqa: E402

TOPICS = ["the ocean", "a mountain village", "the history of clocks", "a robot who paints",
          "winter in Norway", "the first airplane", "a lost cat", "coffee farming"]
KEY = "bench-key"
LLAMA_SERVER = """
import runpy, sys
import llama_cpp, llama_cpp.llama as lm
original = llama_cpp.llama_model_default_params
def without_extra_bufts():
    p = original()
    p.use_extra_bufts = False
    return p
lm.llama_cpp.llama_model_default_params = without_extra_bufts
sys.argv = ["llama_cpp.server", *sys.argv[1:]]
runpy.run_module("llama_cpp.server", run_name="__main__")
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def prompt(i: int) -> str:
    return f"Here is a short story about {TOPICS[i % len(TOPICS)]}. Once upon a time,"


async def one_stream(client: httpx.AsyncClient, body: dict[str, Any], headers: dict[str, str]
                     ) -> tuple[float, list[float], int]:
    """(TTFT, inter-chunk gaps, chunks with text) of one streamed completion."""
    t0 = time.perf_counter()
    stamps: list[float] = []
    async with client.stream("POST", "/v1/completions", json=body, headers=headers,
                             timeout=300) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                stamps.append(time.perf_counter())
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return (stamps[0] - t0 if stamps else float("nan")), gaps, len(stamps)


async def measure(client_kwargs: dict[str, Any], body: dict[str, Any],
                  headers: dict[str, str], levels: list[int], rounds: int) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=max(levels) + 1)
    async with httpx.AsyncClient(limits=limits, **client_kwargs) as client:
        return await _measure(client, body, headers, levels, rounds)


async def _measure(client: httpx.AsyncClient, body: dict[str, Any], headers: dict[str, str],
                   levels: list[int], rounds: int) -> dict[str, Any]:
    await one_stream(client, {**body, "prompt": prompt(0), "max_tokens": 8}, headers)  # warm up
    out = {}
    for n in levels:
        ttft: list[float] = []
        itl: list[float] = []
        rates = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            res = await asyncio.gather(*(one_stream(client, {**body, "prompt": prompt(i)},
                                                    headers) for i in range(n)))
            wall = time.perf_counter() - t0
            rates.append(sum(r[2] for r in res) / wall)
            ttft += [r[0] for r in res]
            itl += [g for r in res for g in r[1]]
        out[str(n)] = {"ttft_p50_ms": 1000 * percentile(ttft, 50),
                       "ttft_p99_ms": 1000 * percentile(ttft, 99),
                       "itl_p50_ms": 1000 * percentile(itl, 50),
                       "itl_p99_ms": 1000 * percentile(itl, 99),
                       "tokens_per_s": sum(rates) / len(rates)}
        print(f"  {n} clients: {out[str(n)]}", file=sys.stderr)
    return out


def wait_ready(proc: subprocess.Popen[bytes], probe: Any, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if probe():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("server did not become ready")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def run_localllm(args: argparse.Namespace, model: Path, levels: list[int]) -> dict[str, Any]:
    sock = Path(tempfile.mkdtemp()) / "bench.sock"
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "localllm.apps.cli", "serve", "--model",
                             str(model), "--threads", str(args.threads), "--socket", str(sock),
                             "--port", str(port), "--api-key", KEY, "--max-model-len",
                             str(args.ctx)], stderr=subprocess.DEVNULL)
    body = {"max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    auth = {"Authorization": f"Bearer {KEY}"}
    try:
        unix = httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://x")
        wait_ready(proc, lambda: unix.get("/health").status_code == 200)
        results = {}
        for name, kwargs in (
                ("unix", {"transport": httpx.AsyncHTTPTransport(uds=str(sock)),
                          "base_url": "http://x"}),
                ("tcp", {"base_url": f"http://127.0.0.1:{port}"})):
            print(f"localllm serve over {name}", file=sys.stderr)
            results[name] = asyncio.run(measure(kwargs, body, auth, levels, args.rounds))
        return results
    finally:
        stop(proc)


def start_llama(model: Path, threads: int, ctx: int) -> tuple[subprocess.Popen[bytes], str]:
    """`python -m llama_cpp.server` on a free loopback port, ready: (process, base URL)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", LLAMA_SERVER, "--model", str(model),
                             "--host", "127.0.0.1", "--port", str(port), "--n_threads",
                             str(threads), "--n_threads_batch", str(threads),
                             "--n_ctx", str(ctx), "--interrupt_requests", "False",
                             "--verbose", "False"], stderr=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, lambda: httpx.get(f"{base}/v1/models").status_code == 200)
    except BaseException:
        stop(proc)
        raise
    return proc, base


def run_llama(args: argparse.Namespace, model: Path, levels: list[int]) -> dict[str, Any]:
    body = {"max_tokens": args.max_tokens, "temperature": 0, "stream": True,
            "logit_bias": {str(t): -100.0 for t in args.end_ids}}
    proc, base = start_llama(model, args.threads, args.ctx)
    try:
        print("llama_cpp.server over tcp", file=sys.stderr)
        return {"tcp": asyncio.run(measure({"base_url": base}, body, {}, levels, args.rounds))}
    finally:
        stop(proc)


def machine() -> dict[str, Any]:
    import llama_cpp

    return {"cpu": cpu_model(), "cores": os.cpu_count(), "python": platform.python_version(),
            "llama_cpp_python": llama_cpp.__version__}


def table(results: dict[str, Any], levels: list[int]) -> str:
    rows = ["| server | transport | clients | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | "
            "aggregate tokens/s |", "|---|---|---|---|---|---|"]
    for server, by_transport in results.items():
        for transport, by_level in by_transport.items():
            for n in levels:
                r = by_level[str(n)]
                rows.append(f"| {server} | {transport} | {n} | {r['ttft_p50_ms']:.0f} / "
                            f"{r['ttft_p99_ms']:.0f} | {r['itl_p50_ms']:.1f} / "
                            f"{r['itl_p99_ms']:.1f} | {r['tokens_per_s']:.0f} |")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--json", default=None)
    args = p.parse_args()
    model = find_model(args.model)
    from localllm.gguf.reader import GGUFFile
    from localllm.text.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf_metadata(GGUFFile(model).metadata)
    args.end_ids = sorted(tok.stop_ids)
    results = {"localllm": run_localllm(args, model, args.clients),
               "llama_cpp.server": run_llama(args, model, args.clients)}
    print(table(results, args.clients))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "machine": machine(), "model": model.name, "threads": args.threads,
            "max_tokens": args.max_tokens, "rounds": args.rounds, "results": results},
            indent=2) + "\n")


if __name__ == "__main__":
    main()
