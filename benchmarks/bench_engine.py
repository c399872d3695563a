"""Engine benchmark: continuous batching and the prefix cache, through AsyncLLMEngine.

    python benchmarks/bench_engine.py [--model PATH] [--dtype bfloat16] [--threads 2]
                                      [--sessions 8] [--decode-tokens 64] [--prefix-tokens 1000]
                                      [--repeat 3] [--profile] [--json OUT]

Decode: aggregate tokens/s of --sessions concurrent greedy streams vs one stream, counting the
tokens sampled after every stream has its first token (so prefill is left out), in one run.
Target: >= 4x. The same with chat's sampling (temperature 0.8, top-k 40, top-p 0.95, min-p
0.05, as `localllm chat` and the API default to; seeded). Prefix: time to first token of a
prompt whose ~--prefix-tokens prefix is in the KV cache (a follow-up turn: same prefix, new
last line) vs the same prompt cold. Target: >= 10x.
--profile: time one decode step split into the model's layers (with the LM head where greedy
steps run several to a call), the logits, sampling, `ModelRunner._prepare` and the rest, at 1
and at --sessions sequences (in the loading thread,
with --threads torch threads), in wall time and in the calling thread's CPU time (`cpu_*`: on
a shared machine it leaves out the time the thread waited for a core).
--no-prefix: skip the TTFT rounds (decode figures only).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from localllm import LLM, CacheConfig, SamplingParams, SchedulerConfig  # noqa: E402
from localllm.backends.cpu.dispatch import native_kernels  # noqa: E402
from localllm.engine.async_engine import AsyncLLMEngine  # noqa: E402
from localllm.engine.engine import RequestOutput  # noqa: E402
from localllm.engine.metrics import EngineSnapshot, percentile  # noqa: E402
from localllm.engine.request import Request  # noqa: E402
from localllm.kernels import cpu_native  # noqa: E402
from localllm.machine import cpu_model  # noqa: E402
from localllm.model_path import resolve_model  # noqa: E402
from localllm.server.params import DEFAULTS  # noqa: E402

TEXT = ("The committee met on Tuesday to discuss the budget for the new library. Members argued "
        "about the number of reading rooms, the size of the children's section, and whether the "
        "old card catalogue should be kept as a historical exhibit. ")
GREEDY: dict[str, Any] = {"temperature": 0}
CHAT: dict[str, Any] = {**DEFAULTS, "seed": 0}  # chat's and the API's sampling
del CHAT["repeat_penalty"]
TOPICS = ["the ocean", "a mountain village", "the history of clocks", "a robot who paints",
          "winter in Norway", "the first airplane", "a lost cat", "coffee farming"]


async def stream_all(engine: AsyncLLMEngine, prompts: list[list[int]], params: SamplingParams,
                     samples: list[EngineSnapshot]) -> list[list[RequestOutput]]:
    async def one(ids: list[int]) -> list[RequestOutput]:
        out: list[RequestOutput] = []
        async for o in engine.generate(ids, params):
            out.append(o)
            samples.append(engine.stats())
        return out
    return await asyncio.gather(*(one(p) for p in prompts))


def decode_rate(engine: AsyncLLMEngine, prompts: list[list[int]], n: int, sample: bool = False
                ) -> tuple[float, list[float], list[EngineSnapshot]]:
    """Aggregate decode tokens/s after the last first token, greedy (or with chat's sampling);
    also every stream's ITLs."""
    llm_engine = engine.engine
    seen: list[Request] = []
    add = llm_engine.add_request

    def spy(*a: Any) -> Request:
        seen.append(add(*a))
        return seen[-1]

    llm_engine.add_request = spy  # type: ignore[method-assign]
    samples: list[EngineSnapshot] = []
    try:
        params = SamplingParams(max_tokens=n, ignore_eos=True, **(CHAT if sample else GREEDY))
        asyncio.run(stream_all(engine, prompts, params, samples))
    finally:
        del llm_engine.add_request
    t0 = max(r.times.token_times[0] for r in seen)
    t1 = max(r.times.token_times[-1] for r in seen)
    tokens = sum(sum(1 for t in r.times.token_times if t > t0) for r in seen)
    itl = [x for r in seen for x in r.times.itl]
    return tokens / (t1 - t0), itl, samples


def ttft(engine: AsyncLLMEngine, ids: list[int]) -> float:
    async def run() -> float:
        t = time.perf_counter()
        async for _ in engine.generate(ids, SamplingParams(max_tokens=1, temperature=0)):
            return time.perf_counter() - t
        raise AssertionError("no output")
    return asyncio.run(run())


def timed(fn: Callable[..., Any], acc: list[float], cpu: list[float],
          less: tuple[list[float], list[float]] | None = None) -> Callable[..., Any]:
    """fn, appending each call's wall time to `acc` and the calling thread's CPU time to
    `cpu`, less what other timed calls inside it added to the lists `less` (wall, CPU)."""
    def wrapper(*a: Any) -> Any:
        inner = (sum(less[0]), sum(less[1])) if less else (0.0, 0.0)
        t, c = time.perf_counter(), time.thread_time()
        try:
            return fn(*a)
        finally:
            wall, own = time.perf_counter() - t, time.thread_time() - c
            if less:
                wall -= sum(less[0]) - inner[0]
                own -= sum(less[1]) - inner[1]
            acc.append(wall)
            cpu.append(own)
    return wrapper


def profile_step(llm: LLM, prompts: list[list[int]], threads: int) -> dict[str, float]:
    """ms per decode step at batch 1 and batch len(prompts): the model (`ModelRunner._step`:
    one native call a step where the backend's whole-step path runs: the projections,
    attention and norms of every layer, and the LM head where that path has it; and
    `ModelRunner.execute_steps`, where greedy steps run several to a call: those steps'
    layers and LM head), the logits (`ModelRunner.logits`: the LM head where the model's step
    did not run it), sampling, `ModelRunner._prepare`, and the rest (scheduler,
    detokenization, Python); each also as this thread's CPU time (`cpu_` names). A step is a
    decode step (`EngineStats.steps`), however many of them a call ran."""
    eng = llm.engine
    runner = eng.runner
    res: dict[str, float] = {}
    torch.set_num_threads(threads)
    for n in (1, len(prompts)):
        names = ("model", "logits", "sample", "prepare")
        parts: dict[str, list[float]] = {k: [] for k in names}
        cpu: dict[str, list[float]] = {k: [] for k in names}
        fwd, logits, prepare, sampler = runner._step, runner.logits, runner._prepare, eng.sampler
        greedy = runner.execute_steps
        params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
        for p in prompts[:n]:
            eng.add_request(p, params)
        for _ in range(8):  # prefill and warm-up
            eng.step()
        runner._step = timed(fwd, parts["model"], cpu["model"])  # type: ignore[method-assign]
        runner.logits = timed(logits, parts["logits"], cpu["logits"])  # type: ignore[method-assign]
        runner._prepare = timed(  # type: ignore[method-assign]
            prepare, parts["prepare"], cpu["prepare"])
        # its inputs' _prepare counts as `prepare`: the model is the call less that
        runner.execute_steps = timed(  # type: ignore[method-assign]
            greedy, parts["model"], cpu["model"], (parts["prepare"], cpu["prepare"]))
        eng.sampler = timed(sampler, parts["sample"], cpu["sample"])  # type: ignore[assignment]
        calls, before = 16, eng.stats.steps
        t, c = time.perf_counter(), time.thread_time()
        for _ in range(calls):
            eng.step()
        steps = eng.stats.steps - before
        total, total_cpu = (time.perf_counter() - t) / steps, (time.thread_time() - c) / steps
        del runner._step, runner.logits, runner._prepare, runner.execute_steps
        eng.sampler = sampler
        while eng.has_unfinished():
            eng.step()
        for prefix, whole, table in (("", total, parts), ("cpu_", total_cpu, cpu)):
            res[f"{prefix}step_ms@{n}"] = 1e3 * whole
            for name, times in table.items():
                res[f"{prefix}{name}_ms@{n}"] = 1e3 * sum(times) / steps
            res[f"{prefix}rest_ms@{n}"] = res[f"{prefix}step_ms@{n}"] - sum(
                res[f"{prefix}{name}_ms@{n}"] for name in table)
    torch.set_num_threads(1)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--prefix-tokens", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--no-prefix", action="store_true", help="skip the TTFT rounds")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)  # this thread loads; the engine thread computes (AsyncLLMEngine)
    path = resolve_model(args.model)
    # the in-memory prefix cache only: "cold" prefixes stored on disk by an earlier run would hit
    llm = LLM(path, dtype=args.dtype, cache=CacheConfig(memory_bytes=256 << 20, prefix_cache=False),
              scheduler=SchedulerConfig(max_num_seqs=max(16, args.sessions),
                                        max_num_batched_tokens=512))
    engine = AsyncLLMEngine(llm.engine, num_threads=args.threads)
    prompts = [llm.encode_chat([{"role": "user", "content": f"Write a short story about {t}."}])
               for t in (TOPICS * (args.sessions // len(TOPICS) + 1))[:args.sessions]]
    ttft(engine, prompts[0])  # warm-up

    one_rates, many_rates, itl_one, itl_many = [], [], [], []
    sampled_one, sampled_many = [], []
    kv_peak = 0.0
    for _ in range(args.repeat):
        r, itl, _ = decode_rate(engine, prompts[:1], args.decode_tokens)
        one_rates.append(r)
        itl_one += itl
        r, itl, samples = decode_rate(engine, prompts, args.decode_tokens)
        many_rates.append(r)
        itl_many += itl
        kv_peak = max([kv_peak] + [s.kv_utilization for s in samples])
        sampled_one.append(decode_rate(engine, prompts[:1], args.decode_tokens, True)[0])
        sampled_many.append(decode_rate(engine, prompts, args.decode_tokens, True)[0])
    one, many = max(one_rates), max(many_rates)
    chat_one, chat_many = max(sampled_one), max(sampled_many)

    base = llm.encode(TEXT * (args.prefix_tokens // 40 + 2))[:args.prefix_tokens]
    cold_t, warm_t, cached = [], [], []
    for i in range(0 if args.no_prefix else args.repeat):
        prefix = base[:1] + [base[1] + i + 1] + base[2:]  # a fresh prefix each round
        before = llm.engine.bm.prefix_hits
        cold_t.append(ttft(engine, prefix + llm.encode("Question: who chaired it?")[1:]))
        warm_t.append(ttft(engine, prefix + llm.encode("Question: what did it decide?")[1:]))
        cached.append(llm.engine.bm.prefix_hits - before)
    cold = statistics.median(cold_t) if cold_t else float("nan")
    warm = statistics.median(warm_t) if warm_t else float("nan")
    snap = engine.stats()
    engine.shutdown()

    def itl(gaps: list[float]) -> str:
        # greedy steps run several to a call (SchedulerConfig.decode_steps): a call's tokens
        # arrive together (gaps under 1 ms apart), so the per-token figure is the mean gap
        # (TPOT) and the arrivals' own gaps say how long a reader waits
        arrivals = [g for g in gaps if g >= 1e-3]
        if not arrivals:
            return f"TPOT {1e3 * statistics.fmean(gaps):.1f} ms"
        return (f"TPOT {1e3 * statistics.fmean(gaps):.1f} ms; {len(gaps) / len(arrivals):.1f} "
                f"tokens an arrival, every {1e3 * percentile(arrivals, 50):.1f} ms (p50), "
                f"{1e3 * percentile(arrivals, 90):.1f} (p90)")

    rows: list[tuple[str, str, str]] = [
        ("decode, 1 session", f"{one:.1f} tok/s", itl(itl_one)),
        (f"decode, {args.sessions} sessions (aggregate)", f"{many:.1f} tok/s", itl(itl_many)),
        (f"decode ratio {args.sessions}:1", f"{many / one:.2f}x", "target >= 4x"),
        ("decode, 1 session, chat sampling", f"{chat_one:.1f} tok/s",
         f"{chat_one / one:.2f}x greedy"),
        (f"decode, {args.sessions} sessions, chat sampling", f"{chat_many:.1f} tok/s",
         f"{chat_many / many:.2f}x greedy"),
    ]
    if cold_t:  # not with --no-prefix
        rows += [
            (f"TTFT, {len(base)}-token prompt cold", f"{1e3 * cold:.1f} ms", ""),
            ("TTFT, same prefix cached", f"{1e3 * warm:.1f} ms",
             f"{statistics.median(cached):.0f} tokens reused"),
            ("TTFT ratio cold:cached", f"{cold / warm:.1f}x", "target >= 10x"),
        ]
    rows += [
        ("KV utilization, peak while decoding", f"{100 * kv_peak:.1f} %",
         f"{snap.num_blocks} blocks"),
        ("prefix-cache hit rate (whole run)", f"{100 * snap.prefix_hit_rate:.1f} %",
         f"{snap.prefix_hits}/{snap.prefix_queries} prompt tokens"),
        ("tokens per step (mean)", f"{snap.mean_tokens_per_step:.2f}",
         f"{snap.steps} steps, {snap.preemptions} preemptions"),
    ]
    prof = profile_step(llm, prompts, args.threads) if args.profile else {}
    for k, v in prof.items():
        rows.append((f"profile {k}", f"{v:.2f}", ""))
    w = max(len(r[0]) for r in rows)
    print(f"\nlocalllm engine, {path.name}, {args.dtype}, {args.threads} threads, "
          f"{platform.machine()}, CPU {cpu_model()}, native kernels {native_kernels()}")
    for name, value, note in rows:
        print(f"  {name:<{w}}  {value:>14}  {note}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "model": path.name, "dtype": args.dtype, "threads": args.threads,
            "cpu": cpu_model(), "native_isa": cpu_native.isa(),
            "amx_decode": cpu_native.amx_mode(), "sessions": args.sessions,
            "decode_tokens": args.decode_tokens,
            "decode_1_tok_s": one, "decode_n_tok_s": many, "decode_ratio": many / one,
            "chat_decode_1_tok_s": chat_one, "chat_decode_n_tok_s": chat_many,
            "ttft_cold_s": cold, "ttft_cached_s": warm, "ttft_ratio": cold / warm,
            "kv_peak_utilization": kv_peak, "prefix_hit_rate": snap.prefix_hit_rate,
            "mean_tokens_per_step": snap.mean_tokens_per_step, "profile": prof,
        }, indent=2))


if __name__ == "__main__":
    main()
