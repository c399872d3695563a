"""`localllm summarize` throughput: 20 files all at once vs one at a time, in one run.

    python benchmarks/bench_summarize.py [--model PATH] [--threads 2] [--files 20]
                                         [--max-words 50] [--repeat 1] [--json OUT]

Both runs summarize the same files (distinct texts of about 250 tokens each) through one
LocalClient and the Summarizer that `localllm summarize` runs, with its prompt and greedy
sampling: once with every file in flight (concurrency = --files) and once with concurrency 1.
File reading and writing are left out (they take microseconds). Prints files/s and output
tokens/s of each and their ratio; --repeat keeps each run's best; --json saves the figures
and the 1-minute load average before and after (other work on the machine slows both runs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from localllm.apps.summarize_split import Summarizer, default_instruction  # noqa: E402
from localllm.client.local import LocalClient  # noqa: E402
from localllm.config import CacheConfig, SamplingParams  # noqa: E402
from localllm.llm import LLM  # noqa: E402
from localllm.model_path import resolve_model  # noqa: E402

SUBJECTS = ["the town library", "a river ferry", "the school garden", "a night train",
            "the bakery on Main Street", "a mountain observatory", "the harbour market",
            "a bicycle repair shop", "the village orchestra", "a lighthouse keeper",
            "the winter festival", "a beekeeping club", "the city zoo", "a paper mill",
            "the old clock tower", "a chess tournament", "the weather station",
            "a sailing school", "the museum of maps", "a community radio station"]
FACTS = ["It opened {n} years ago and now serves about {m} people each week.",
         "Its budget grew by {n} percent after a vote by the council last spring.",
         "Volunteers repaired the roof, painted {n} rooms and planted {m} trees nearby.",
         "Visitors praise the staff, but many ask for longer opening hours on weekends.",
         "A new director plans {n} workshops and a festival with {m} guests next year.",
         "Local newspapers reported a record season with {m} tickets sold in total."]


def make_files(n: int) -> list[tuple[str, str]]:
    files = []
    for i in range(n):
        subject = SUBJECTS[i % len(SUBJECTS)]
        paras = []
        for p in range(3):
            body = " ".join(f.format(n=i + p + 3, m=100 * (i + 1) + p) for f in FACTS)
            paras.append(f"Report {p + 1} on {subject}. {body}")
        files.append((f"report_{i:02}.txt", "\n\n".join(paras) + "\n"))
    return files


async def summarize_all(client: LocalClient, files: list[tuple[str, str]], concurrency: int,
                        params: SamplingParams, instruction: str) -> dict[str, float]:
    summarizer = Summarizer(client, instruction, params, concurrency)
    t0 = time.perf_counter()
    results = await asyncio.gather(*(summarizer.summarize(name, text) for name, text in files))
    seconds = time.perf_counter() - t0
    out = sum(r.output_tokens for r in results)
    return {"concurrency": concurrency, "seconds": seconds, "files_per_s": len(files) / seconds,
            "output_tokens": out, "output_tok_s": out / seconds,
            "prompt_tokens": sum(r.prompt_tokens for r in results),
            "requests": sum(r.requests for r in results)}


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    load_before = os.getloadavg()[0]
    path = resolve_model(args.model)
    llm = LLM(path, dtype=args.dtype, cache=CacheConfig(prefix_cache=False), num_threads=1)
    client = LocalClient(llm, num_threads=args.threads)
    files = make_files(args.files)
    params = SamplingParams(max_tokens=2 * args.max_words + 16, temperature=0)
    instruction = default_instruction(args.max_words)
    try:
        await summarize_all(client, files[:2], 2, params, instruction)  # warm-up
        best: dict[int, dict[str, float]] = {}
        for _ in range(args.repeat):
            for c in (args.files, 1):
                r = await summarize_all(client, files, c, params, instruction)
                if c not in best or r["seconds"] < best[c]["seconds"]:
                    best[c] = r
        prompt_tokens = [await client.chat_tokens(Summarizer(
            client, instruction, params, 1).messages(Summarizer.whole(n, t))) for n, t in files]
    finally:
        await client.aclose()
    at_once, one = best[args.files], best[1]
    return {"model": path.name, "dtype": args.dtype, "threads": args.threads,
            "files": args.files, "max_words": args.max_words,
            "load_average_1min": [load_before, os.getloadavg()[0]],  # before, after
            "max_tokens": params.max_tokens,
            "mean_prompt_tokens": sum(p or 0 for p in prompt_tokens) / len(files),
            "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
            "all_at_once": at_once, "one_at_a_time": one,
            "files_per_s_ratio": at_once["files_per_s"] / one["files_per_s"],
            "output_tok_s_ratio": at_once["output_tok_s"] / one["output_tok_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--files", type=int, default=20)
    ap.add_argument("--max-words", type=int, default=50)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    r = asyncio.run(bench(args))
    print(f"{r['model']} {r['dtype']}, {r['threads']} threads: {r['files']} files of about "
          f"{r['mean_prompt_tokens']:.0f} prompt tokens, summaries of up to {r['max_tokens']} "
          f"tokens")
    print(f"{'run':<16}{'seconds':>9}{'files/s':>9}{'out tokens':>12}{'out tok/s':>11}")
    for label, key in ((f"all at once ({r['files']})", "all_at_once"),
                       ("one at a time", "one_at_a_time")):
        x = r[key]
        print(f"{label:<16}{x['seconds']:>9.2f}{x['files_per_s']:>9.2f}"
              f"{x['output_tokens']:>12}{x['output_tok_s']:>11.1f}")
    print(f"ratio: files/s {r['files_per_s_ratio']:.2f}x, output tokens/s "
          f"{r['output_tok_s_ratio']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=2) + "\n")


if __name__ == "__main__":
    main()
