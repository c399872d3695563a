"""`localllm bench serve`: a serving workload against the in-process engine or an
OpenAI-compatible server (`--endpoint`), its latency report, and what limits it.

The in-process engine runs without the on-disk prefix store (the prompts of a seeded workload
would be served from an earlier run's store) unless --prefix-cache-dir names one.

`add_parser(bench_subparsers, model_args)` adds the `serve` subcommand; `cmd_bench_serve(args,
load_llm)` runs it (the whole benchmark on one event loop, as a client lives on one).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from localllm.apps.connect import LoadFn, add_endpoint_args
from localllm.errors import LocalLLMError

if TYPE_CHECKING:
    from localllm.client import Client

DESCRIPTION = """\
A serving workload against the in-process engine or an OpenAI-compatible server (--endpoint):
its latency, throughput and goodput, the engine's state over time, and what limits latency.
The in-process engine runs without the on-disk prefix store (the prompts of a seeded workload
would come from an earlier run's store) unless --prefix-cache-dir names one.
"""
EPILOG = """\
what is measured (client-side: the time each streamed delta arrives, as `vllm bench serve`):
  TTFT   time to first token: from sending a request to its first streamed token
  ITL    inter-token latency: each gap between consecutive token-carrying deltas
  TPOT   time per output token after the first: (E2E - TTFT) / (output tokens - 1)
  E2E    end-to-end latency: from sending a request to the end of its stream
  each as mean / p50 / p90 / p99 (ITL over every gap of every request)
  output throughput: output tokens of completed requests / the run's duration (first arrival
    to last end); per request: its output tokens / its E2E
  goodput: completed requests that meet every SLO given (TTFT, largest ITL gap, TPOT, E2E)
    per second of the run
  prefix-cache hit rate: prompt tokens the server reports as cached / prompt tokens
  engine state, sampled every 50 ms: KV-cache utilization (blocks held by live requests),
    running and waiting requests, preemptions (in-process: the engine's snapshot; remote:
    /metrics of `localllm serve` or vLLM)
diagnosis (one or two lines, with the setting to change):
  kv-capacity-bound     preemptions, or the KV cache >= 95% full while requests wait
  queueing-bound        requests wait while the KV cache has room: TTFT is queue time
  prefill-interference  gaps between tokens are >= 2x longer while another prompt is
                        processed, and such gaps take >= 20% of all time between tokens
  cpu-contention        in-process: the engine got under 60% of the CPU time its threads
                        could use while it had work (other processes take the cores)
  compute-bound         nothing waits, yet the gap between tokens grows >= 1.5x with the
                        number of requests decoding at once
"""


def _fraction(text: str) -> float:
    v = float(text)
    if not 0 <= v <= 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text}")
    return v


def _positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        v = kind(text)
        if v <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return v
    return parse


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser],
               model_args: Any) -> None:
    p = sub.add_parser("serve", help="serving latency, throughput and goodput under a workload",
                       description=DESCRIPTION, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    model_args(p)
    add_endpoint_args(p)
    p.add_argument("--max-num-seqs", type=_positive(int), default=None,
                   help="in-process engine: requests running at once (default: 16)")
    p.add_argument("--max-num-batched-tokens", type=_positive(int), default=None,
                   help="in-process engine: tokens of one step, i.e. the prefill chunk "
                   "(default: 512)")
    w = p.add_argument_group("workload")
    w.add_argument("--num-requests", "-n", type=_positive(int), default=32,
                   help="requests to send (default: 32)")
    w.add_argument("--concurrency", type=_positive(int), default=None,
                   help="at most this many requests open at once (default: 4 without "
                   "--request-rate, else no limit)")
    w.add_argument("--request-rate", type=_positive(float), default=math.inf,
                   help="requests/s arriving as a Poisson process (default: inf, all at once "
                   "up to --concurrency)")
    w.add_argument("--burstiness", type=_positive(float), default=1.0,
                   help="shape of the gamma distribution of the gaps between arrivals: 1 "
                   "Poisson, < 1 burstier, > 1 more even (default: 1)")
    w.add_argument("--input-len", type=_positive(int), default=256,
                   help="prompt tokens (default: 256)")
    w.add_argument("--input-range", type=_fraction, default=0.0,
                   help="prompt lengths uniform in input-len x [1 - r, 1 + r] (default: 0)")
    w.add_argument("--output-len", type=_positive(int), default=64,
                   help="output tokens, generated to length: end-of-text is ignored "
                   "(default: 64)")
    w.add_argument("--output-range", type=_fraction, default=0.0,
                   help="output lengths uniform in output-len x [1 - r, 1 + r] (default: 0)")
    w.add_argument("--shared-prefix", type=_fraction, default=0.0,
                   help="fraction of the mean prompt that every prompt shares, to exercise "
                   "the prefix cache (default: 0)")
    w.add_argument("--dataset", type=Path, default=None, metavar="FILE.jsonl",
                   help="prompts from a file: a JSON string or {\"prompt\": ...} or "
                   "{\"messages\": [...]} a line, optionally with \"output_len\"")
    w.add_argument("--seed", type=int, default=0, help="seed of the workload (default: 0)")
    w.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature (default: 0, greedy)")
    w.add_argument("--extra-body", type=json.loads, default=None, metavar="JSON",
                   help="more JSON fields for each request to --endpoint, e.g. "
                   "'{\"min_tokens\": 64}' for a server without ignore_eos")
    s = p.add_argument_group("SLOs for goodput (milliseconds)")
    s.add_argument("--slo-ttft", type=_positive(float), default=None)
    s.add_argument("--slo-itl", type=_positive(float), default=None,
                   help="the largest gap between two tokens of a request")
    s.add_argument("--slo-tpot", type=_positive(float), default=None)
    s.add_argument("--slo-e2e", type=_positive(float), default=None)
    o = p.add_argument_group("output")
    o.add_argument("--json", type=Path, default=None, metavar="FILE",
                   help="every request's raw timeline, engine samples, settings and machine")
    o.add_argument("--plot", type=Path, default=None, metavar="FILE.png",
                   help="latency CDFs and timelines (needs matplotlib: localllm[plot])")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")


async def _workload(client: Client, args: argparse.Namespace) -> tuple[list[Any], list[float]]:
    import numpy as np

    from localllm.apps import bench_serve_workload as wl

    rng = np.random.default_rng(args.seed)
    n = args.num_requests
    outs = wl.lengths(rng, args.output_len, args.output_range, n)
    if args.dataset is not None:
        specs = await wl.from_dataset(client, args.dataset, n, outs)
    else:
        ins = wl.lengths(rng, args.input_len, args.input_range, n)
        specs = await wl.synthetic(client, n, ins, outs, args.shared_prefix, rng)
    context = client.context
    if context:
        for s in specs:
            if s.input_len + s.output_len > context:
                raise LocalLLMError(f"a request of {s.input_len} prompt + {s.output_len} output "
                                    f"tokens does not fit the {context}-token context: lower "
                                    "--input-len / --output-len")
    return specs, wl.arrivals(rng, n, args.request_rate, args.burstiness)


async def _bench(args: argparse.Namespace, load_llm: LoadFn) -> int:
    from localllm.apps import bench_serve_report as report
    from localllm.apps.bench_serve_runner import run_workload
    from localllm.apps.connect import open_client
    from localllm.bench.diagnosis import cpu_share, diagnose, signals
    from localllm.bench.summary import Slo, summarize, summarize_engine
    from localllm.client import collect
    from localllm.config import SamplingParams

    slo = Slo(*(None if v is None else v / 1000 for v in (
        args.slo_ttft, args.slo_itl, args.slo_tpot, args.slo_e2e)))
    client = await open_client(args, load_llm)
    try:
        specs, send_at = await _workload(client, args)
        params = SamplingParams(max_tokens=1, temperature=args.temperature, seed=args.seed,
                                ignore_eos=True)
        concurrency = args.concurrency or (4 if math.isinf(args.request_rate) else None)
        # not measured: the first prefill and batched decode steps of a process are slow
        warm = dataclasses.replace(params, max_tokens=2)
        await asyncio.gather(*(collect(client.stream_text(f"Warm up {i}: hello", warm))
                               for i in range(min(concurrency or 4, 4))))
        run = await run_workload(client, specs, send_at, params, concurrency,
                                 progress=not args.no_progress)
    finally:
        await client.aclose()
    measured = [r for r in run.records if r.error != "interrupted"]
    summary = summarize(measured, slo)
    engine = summarize_engine(run.samples)
    share = None
    if not args.endpoint:
        threads = getattr(getattr(client, "engine", None), "num_threads", 0)
        share = cpu_share(run.cpu_seconds, run.wall, threads, run.samples)
    sig = signals(measured, run.samples, share)
    findings = diagnose(sig, local=not args.endpoint, request_rate=summary.request_throughput)
    rate = "all at once" if math.isinf(args.request_rate) else (
        f"{args.request_rate:g} requests/s (burstiness {args.burstiness:g})")
    load = f"{len(specs)} requests, {rate}, concurrency {concurrency or 'unlimited'}"
    print(report.text(client.card, run, summary, engine, slo, findings, load))
    if args.json:
        report.write_json(args.json, args, client, run, summary, engine, sig, findings)
        print(f"[raw timelines: {args.json}]", file=sys.stderr)
    if args.plot:
        from localllm.apps import bench_serve_plot as plot

        plot.save(plot.figure(run, findings, slo), args.plot)
        print(f"[plot: {args.plot}]", file=sys.stderr)
    return 130 if run.interrupted else (0 if summary.completed else 1)


def cmd_bench_serve(args: argparse.Namespace, load_llm: LoadFn) -> int:
    if not args.prefix_cache_dir:
        args.no_prefix_cache = True  # a seeded workload's prompts would come from an earlier run
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise LocalLLMError("--plot needs matplotlib: pip install 'localllm[plot]'"
                                ) from None
    return asyncio.run(_bench(args, load_llm))


def run(args: argparse.Namespace) -> int:
    """The `bench` group's entry (apps/bench.py): `cmd_bench_serve` with the CLI's loader."""
    from localllm.apps.cli import load_llm

    return cmd_bench_serve(args, load_llm)
