"""Prefix cache on disk: time to first token of a long prompt after a restart, in one run.

    python benchmarks/bench_prefix_store.py [--model PATH] [--dtype bfloat16] [--threads 2]
                                            [--tokens 2000] [--repeat 3] [--llama]
                                            [--drop-caches] [--json OUT]

Each round starts two fresh processes on a fresh store directory. The first ("cold") answers
the --tokens prompt with nothing stored, which stores it, then answers it again from the
in-memory prefix cache ("in-memory hit"). The second ("store warm") is a restart: it answers the
same prompt with its full blocks read from the store. Each process first answers a short other
prompt, so the figures compare the prompt's path, not the first step of a process. TTFT is from
the request's arrival to its first token (greedy, one token); the three answers must agree.
Disk bytes per token: the size of the store's entry files (and the space allocated for them)
over the tokens they hold. --drop-caches drops the OS page cache before the restart (as
root), so the store is read from the disk rather than from memory.

--llama: llama.cpp (llama-cpp-python) doing the same by hand, as llama-server's slot
save/restore does: evaluate the prompt, save its state to a file, and in a new process load the
state and answer (llama-server: start with --slot-save-path, POST /slots/0?action=save, restart,
POST /slots/0?action=restore; localllm needs none of these steps).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

TEXT = ROOT / "benchmarks" / "data" / "apache-2.0.txt"
BLOCK_SIZE = 16  # CacheConfig's default: tokens per entry


def prompt_ids(llm: Any, n: int) -> list[int]:
    ids: list[int] = llm.encode(TEXT.read_text() * (1 + n // 2000))[:n]
    return ids


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One process: load, warm up, then TTFT of the prompt (twice when cold)."""
    import torch

    from localllm import LLM, CacheConfig, SamplingParams

    torch.set_num_threads(args.threads)
    llm = LLM(args.model, dtype=args.dtype,
              cache=CacheConfig(prefix_cache=True, prefix_cache_dir=args.store))
    params = SamplingParams(max_tokens=1, temperature=0)
    llm.generate(["Hello, how are you?"], params)
    ids = prompt_ids(llm, args.tokens)
    out: dict[str, Any] = {}
    for name in (["cold", "memory"] if args.child == "cold" else ["store"]):
        before = llm.engine.bm.prefix_hits
        done = llm.generate([ids], params)[0]
        out[name] = {"ttft_ms": 1000 * (done.times.ttft or 0.0), "token": done.token_ids,
                     "cached": llm.engine.bm.prefix_hits - before}
    llm.close()
    out["ids"] = ids
    return out


def llama_child(model: str, ids: list[int], state_file: str, threads: int,
                restore: bool) -> dict[str, Any]:
    """llama.cpp: the prompt's TTFT, then its sequence state saved to `state_file` (as
    llama-server's /slots save does); or (restore) that state loaded, and the TTFT after it."""
    import ctypes

    import llama_cpp
    import numpy as np
    from llama_ref import open_llama

    llm = open_llama(model, n_ctx=len(ids) + 16, n_threads=threads, n_batch=512)
    llm.eval([1, 2, 3])  # warm-up
    llm.reset()
    tokens = (llama_cpp.llama_token * (len(ids) + 16))()
    t0 = time.perf_counter()
    if restore:
        count = ctypes.c_size_t(0)
        llama_cpp.llama_state_seq_load_file(llm._ctx.ctx, state_file.encode(), 0, tokens,
                                            len(tokens), ctypes.byref(count))
        assert list(tokens[:count.value]) == ids
        llm.input_ids[:count.value] = ids
        llm.n_tokens = count.value - 1  # as llama-cpp-python does: the last token again
        llm.eval(ids[-1:])
    else:
        llm.eval(ids)
    logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))
    token = int(np.argmax(logits))  # the last position's: the batch's only logits row
    ttft = time.perf_counter() - t0
    if not restore:
        tokens[:len(ids)] = ids
        llama_cpp.llama_state_seq_save_file(llm._ctx.ctx, state_file.encode(), 0, tokens,
                                            len(ids))
    return {"ttft_ms": 1000 * ttft, "token": [token]}


def run_child(args: argparse.Namespace, mode: str, store: str) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", mode, "--store", store, "--threads",
           str(args.threads), "--dtype", args.dtype, "--tokens", str(args.tokens)]
    if args.model:
        cmd += ["--model", args.model]
    r = subprocess.run(cmd, capture_output=True, text=True, check=True)
    result: dict[str, Any] = json.loads(r.stdout.splitlines()[-1])
    return result


def store_size(store: Path) -> tuple[int, int, int]:
    """(entry files, their bytes, their allocated bytes on disk)."""
    files = list(store.rglob("*.kv"))
    return (len(files), sum(f.stat().st_size for f in files),
            sum(f.stat().st_blocks * 512 for f in files))


def drop_caches() -> None:
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--llama", action="store_true")
    ap.add_argument("--drop-caches", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", choices=["cold", "warm"], help=argparse.SUPPRESS)
    ap.add_argument("--store", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    from localllm.model_path import resolve_model

    args.model = str(resolve_model(args.model))
    rounds: list[dict[str, Any]] = []
    for _ in range(args.repeat):
        with tempfile.TemporaryDirectory(prefix="bench-prefix-") as d:
            first = run_child(args, "cold", d)
            files, size, on_disk = store_size(Path(d))
            if args.drop_caches:
                drop_caches()
            warm = run_child(args, "warm", d)
            rounds.append({**first, **warm, "files": files, "bytes": size, "disk": on_disk})
    tokens_stored = rounds[0]["store"]["cached"]
    answers = {json.dumps(r[k]["token"]) for r in rounds for k in ("cold", "memory", "store")}
    med = {k: statistics.median(r[k]["ttft_ms"] for r in rounds)
           for k in ("cold", "store", "memory")}
    result: dict[str, Any] = {
        "machine": platform.processor() or platform.machine(), "python": platform.python_version(),
        "model": Path(args.model).name, "dtype": args.dtype, "threads": args.threads,
        "prompt_tokens": args.tokens, "tokens_from_store": tokens_stored,
        "same_answer": len(answers) == 1, "ttft_ms": med, "rounds": rounds,
        "entry_bytes_per_token": rounds[0]["bytes"] / (rounds[0]["files"] * BLOCK_SIZE),
        "disk_bytes_per_token": rounds[0]["disk"] / (rounds[0]["files"] * BLOCK_SIZE),
        "page_cache_dropped": args.drop_caches,
    }
    if args.llama:
        result["llama.cpp"] = bench_llama(args, rounds[0]["ids"])
    for r in rounds:
        del r["ids"]
    print(f"TTFT of a {args.tokens}-token prompt ({Path(args.model).name}, {args.dtype}, "
          f"{args.threads} threads; median of {args.repeat} rounds, each in fresh processes)")
    print(f"  cold (nothing stored)       {med['cold']:8.1f} ms")
    print(f"  restart, store warm         {med['store']:8.1f} ms  ({tokens_stored} tokens read; "
          f"{med['cold'] / med['store']:.1f}x sooner than cold)")
    print(f"  in-memory hit (same proc.)  {med['memory']:8.1f} ms")
    if args.llama:
        lc = result["llama.cpp"]
        print(f"  llama.cpp cold / restored by hand   {lc['cold_ms']:.1f} / {lc['restored_ms']:.1f}"
              f" ms (state file {lc['state_bytes_per_token']:.0f} bytes per token)")
    print(f"  same answer in every run: {result['same_answer']}")
    print(f"disk: {result['entry_bytes_per_token']:.0f} bytes per token in entry files "
          f"({result['disk_bytes_per_token']:.0f} allocated)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


def bench_llama(args: argparse.Namespace, ids: list[int]) -> dict[str, Any]:
    from llama_ref import in_child

    with tempfile.TemporaryDirectory(prefix="bench-llama-") as d:
        state = str(Path(d) / "slot.bin")
        cold = in_child(llama_child, args.model, ids, state, args.threads, False)
        size = Path(state).stat().st_size
        if args.drop_caches:
            drop_caches()
        warm = in_child(llama_child, args.model, ids, state, args.threads, True)
    return {"cold_ms": cold["ttft_ms"], "restored_ms": warm["ttft_ms"],
            "cold_token": cold["token"], "restored_token": warm["token"],
            "state_bytes_per_token": size / len(ids)}


if __name__ == "__main__":
    main()
