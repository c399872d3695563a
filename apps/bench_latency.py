"""`localllm bench latency`: prompt processing (pp) and token generation (tg) speed at each
batch size and prefilled context depth, as llama-bench measures them, with TTFT and ITL.

Figures are kernel figures: the model runner is driven with synthetic token ids
(`localllm.engine.latency`), after one warm-up run, and each is the mean ± sample standard
deviation over the repetitions. Definitions:

  pp tokens/s  batch * n_prompt / time of the prefill steps (forward + last-position logits)
  TTFT         those prefill steps + sampling every sequence's first token
  tg tokens/s  batch * n_gen / time of the n_gen decode steps (forward + logits)
  ITL          per decode step: the step + its sampling (mean per repetition; p50/p99 over
               every step of every repetition)
  sample ms    one sampling call over the batch (temperature 0.8, top-k 40, top-p 0.95,
               min-p 0.05), timed apart from the kernels
  tokenize ms  encoding one prompt of n_prompt tokens, timed apart (not in any figure above)

The KV pool is sized for the runs (max batch x (max depth + max(n_prompt, n_gen)) tokens) and
the prefix cache is off, so --kv-cache-memory, --max-model-len and the prefix-cache options
are ignored here.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from localllm.apps.bench_output import FORMATS, Column, render
from localllm.errors import RequestError

TEXT = ("The committee met on Tuesday to discuss the budget for the new library. Members argued "
        "about the number of reading rooms and the size of the children's section. ")


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give whole numbers separated by commas, "
                                         "e.g. 1,4,8") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give non-negative whole numbers")
    return values


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser],
               model_args: Callable[[argparse.ArgumentParser], None]) -> None:
    p = sub.add_parser("latency", help="prompt and generation tokens/s, TTFT and ITL at each "
                       "batch size and context depth (as llama-bench)", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    model_args(p)
    p.add_argument("-p", "--n-prompt", type=int, default=512,
                   help="prompt tokens per sequence (0: no pp test; default: 512)")
    p.add_argument("-n", "--n-gen", type=int, default=128,
                   help="generated tokens per sequence (0: no tg test; default: 128)")
    p.add_argument("-r", "--repetitions", type=int, default=5, help="default: 5")
    p.add_argument("-b", "--batch-size", type=_int_list, default=[1, 4, 8], metavar="B,B,...",
                   help="concurrent sequences (default: 1,4,8)")
    p.add_argument("-d", "--depth", type=_int_list, default=[0, 4096], metavar="D,D,...",
                   help="tokens already in each sequence's KV cache (default: 0,4096)")
    p.add_argument("-o", "--output", default="table", choices=FORMATS, help="default: table")
    p.add_argument("--step-tokens", type=int, default=2048,
                   help="prompt tokens per prefill step at most (default: 2048)")


def _quant(path: Any, tied: bool, quantize: str | None) -> tuple[str, dict[str, int]]:
    """The type holding most of the matrices' parameters, and parameters per stored type."""
    from localllm.weight_bytes import model_entries

    by_type: dict[str, int] = {}
    for e in model_entries(path, tied):
        by_type[e.qtype] = by_type.get(e.qtype, 0) + e.numel
    main = max(by_type, key=lambda q: by_type[q])
    return (quantize or main), by_type


def _tokenize_ms(llm: Any, n_prompt: int, reps: int) -> list[float]:
    text = TEXT * (n_prompt // 20 + 2)
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        ids = llm.encode(text)
        out.append((time.perf_counter() - t) * 1e3 * n_prompt / max(len(ids), 1))
    return out


def _measure(llm: Any, args: argparse.Namespace, base: dict[str, Any],
             tick: Callable[[str], None]) -> Iterator[dict[str, Any]]:
    from localllm.engine.latency import LatencyRunner
    from localllm.engine.metrics import mean_sd, percentile

    p, n, reps = args.n_prompt, args.n_gen, args.repetitions
    max_len = max(args.depth) + max(p, n)
    tok = mean_sd(_tokenize_ms(llm, p, reps)) if p else (0.0, 0.0)
    lr = LatencyRunner(llm.engine.runner, max(args.batch_size), max_len, args.step_tokens)
    for d in args.depth:
        lr.fill_depth(d)  # every sequence: each batch size runs on the first b of them
        for b in args.batch_size:
            point = {**base, "batch": b, "depth": d}
            if p:
                tick(f"pp{p} b{b} d{d}")
                lr.prompt(d, p, b)  # warm-up
                runs = []
                for _ in range(reps):
                    runs.append(lr.prompt(d, p, b))
                    tick(f"pp{p} b{b} d{d}")
                tps = [b * p / r.kernel for r in runs]
                ttft = [(r.kernel + r.sample[0]) * 1e3 for r in runs]
                sample = [r.sample[0] * 1e3 for r in runs]
                yield {**point, "test": f"pp{p}", "tokens": b * p,
                       **_stat("tokens_per_s", tps), **_stat("ttft_ms", ttft),
                       **_stat("sample_ms", sample), "tokenize_ms": tok[0],
                       "tokenize_ms_sd": tok[1]}
            if n:
                tick(f"tg{n} b{b} d{d}")
                lr.generate(d, min(n, 8), b)  # warm-up
                runs = []
                for _ in range(reps):
                    runs.append(lr.generate(d, n, b))
                    tick(f"tg{n} b{b} d{d}")
                itl = [(s + q) * 1e3 for r in runs for s, q in zip(r.steps, r.sample)]
                yield {**point, "test": f"tg{n}", "tokens": b * n,
                       **_stat("tokens_per_s", [b * n / r.kernel for r in runs]),
                       **_stat("itl_ms", [mean_sd([(s + q) * 1e3 for s, q in
                                                   zip(r.steps, r.sample)])[0] for r in runs]),
                       "itl_p50_ms": percentile(itl, 50), "itl_p99_ms": percentile(itl, 99),
                       **_stat("sample_ms", [q * 1e3 for r in runs for q in r.sample])}


def _stat(name: str, values: list[float]) -> dict[str, Any]:
    from localllm.engine.metrics import mean_sd

    mean, sd = mean_sd(values)
    return {name: mean, f"{name}_sd": sd, f"{name}_samples": values}


def _pm(r: dict[str, Any], key: str, digits: int = 2) -> str:
    return f"{r[key]:.{digits}f} ± {r[key + '_sd']:.{digits}f}" if key in r else ""


COLUMNS = [
    Column("model", lambda r: r["model"]["file"], right=False),
    Column("quant", lambda r: r["model"]["quant"], right=False),
    Column("backend", lambda r: r["settings"]["backend"], right=False),
    Column("threads", lambda r: str(r["machine"]["threads"])),
    Column("test", lambda r: r["test"]),
    Column("batch", lambda r: str(r["batch"])),
    Column("depth", lambda r: str(r["depth"])),
    Column("tokens/s", lambda r: _pm(r, "tokens_per_s")),
    Column("TTFT ms", lambda r: _pm(r, "ttft_ms")),
    Column("ITL ms", lambda r: _pm(r, "itl_ms")),
    Column("sample ms", lambda r: _pm(r, "sample_ms", 3)),
]


def _check(args: argparse.Namespace) -> None:
    if args.n_prompt < 0 or args.n_gen < 0 or args.n_prompt + args.n_gen == 0:
        raise RequestError("-p and -n must not be negative, and one of them positive")
    if args.repetitions < 1 or args.step_tokens < 1 or min(args.batch_size) < 1:
        raise RequestError("-r, -b and --step-tokens must be at least 1")


def _context_length(model: str | None) -> int:
    """The model's context length, from its file's header or config.json (nothing loaded)."""
    from localllm.gguf.config import config_of_file
    from localllm.gguf.reader import GGUFFile
    from localllm.hf.config import config_from_hf
    from localllm.hf.loader import read_config
    from localllm.model_path import find_model

    path = find_model(model)
    if path.is_dir():
        return config_from_hf(read_config(path)).context_length
    return config_of_file(GGUFFile(path)).context_length


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from localllm.config import CacheConfig, SchedulerConfig
    from localllm.engine.latency import blocks_per_seq
    from localllm.llm import LLM
    from localllm.loader import stderr_progress
    from localllm.machine import describe

    _check(args)
    max_len = max(args.depth) + max(args.n_prompt, args.n_gen)
    context = _context_length(args.model)
    if max_len > context:  # said before loading
        raise RequestError(f"depth {max(args.depth)} + {max(args.n_prompt, args.n_gen)} "
                           f"tokens exceed the model's context of {context}; "
                           "lower -d, -p or -n")
    blocks = max(args.batch_size) * blocks_per_seq(max_len, 16)
    # the engine's context is the runs' longest sequence, which the pool holds: no warning
    # about a pool smaller than the model's context (whose advice, --kv-cache-memory, does not
    # apply here)
    llm = LLM(args.model, dtype=args.dtype, cache=CacheConfig(num_blocks=blocks,
                                                              prefix_cache=False),
              scheduler=SchedulerConfig(max_model_len=max_len),
              num_threads=args.threads, quantize=args.quantize, device=args.device,
              backend=args.backend, progress=stderr_progress("loading"))
    print(f"[{llm.path.name}: {llm.backend.name} backend on {llm.backend.device.type}, "
          f"{llm.engine.kv_summary()}]", file=sys.stderr)
    cfg = llm.config
    quant, types = _quant(llm.path, cfg.tie_word_embeddings, args.quantize)
    base = {"machine": describe(llm.backend.name, llm.backend.device),
            "model": {"path": str(llm.path), "file": llm.path.name, "name": cfg.name,
                      "arch": cfg.arch, "params": sum(types.values()), "quant": quant,
                      "params_by_type": types},
            "settings": {"backend": llm.backend.name, "dtype": args.dtype,
                         "n_prompt": args.n_prompt, "n_gen": args.n_gen,
                         "repetitions": args.repetitions, "batch_sizes": args.batch_size,
                         "depths": args.depth, "step_tokens": args.step_tokens,
                         "kv_block_size": 16}}
    tests = (args.n_prompt > 0) + (args.n_gen > 0)
    total = len(args.batch_size) * len(args.depth) * tests * (args.repetitions + 1)
    records: list[dict[str, Any]] = []
    # on a terminal only (disable=None)
    bar = tqdm(total=total, file=sys.stderr, unit="run", leave=False, disable=None)

    def tick(label: str) -> None:
        bar.set_description(label)
        bar.update(1)

    code = 0
    try:
        for rec in _measure(llm, args, base, tick):
            records.append(rec)
    except KeyboardInterrupt:
        code = 130
    finally:
        bar.close()
    print(format_records(records, args.output))
    if code:
        print(f"localllm: interrupted: {len(records)} measurement(s) shown", file=sys.stderr)
    return code


def format_records(records: list[dict[str, Any]], fmt: str) -> str:
    if not records:
        return "" if fmt != "json" else "[]"
    m, s = records[0]["machine"], records[0]["settings"]
    gpu = f", GPU {m['gpu']}" if m["gpu"] else ""
    header = [f"machine: {m['cpu']} ({m['cores']} cores, {m['threads']} threads){gpu}; "
              f"{m['backend']} backend on {m['device']}, native kernels: {m['native_kernels']}",
              f"settings: {s['dtype']}, {s['repetitions']} repetitions after a warm-up, "
              f"synthetic token ids; tokens/s, TTFT and ITL: mean ± sd"]
    pp = [r for r in records if "tokenize_ms" in r]
    footer = ([f"tokenize (not in the figures): {pp[0]['tokenize_ms']:.2f} ± "
               f"{pp[0]['tokenize_ms_sd']:.2f} ms per prompt of {s['n_prompt']} tokens"]
              if pp else [])
    return render(records, fmt, COLUMNS, header, footer)
