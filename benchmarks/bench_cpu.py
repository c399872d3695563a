"""Prefill and decode speed of localllm beside llama.cpp (and optionally transformers), in one run.

    python benchmarks/bench_cpu.py [--model PATH] [--threads 2] [--prompt-tokens 512]
                                   [--decode-tokens 128] [--decode-depth 0] [--transformers]
                                   [--json OUT]

Prefill: tokens/s of one forward pass over a prompt of --prompt-tokens tokens (pp512).
Decode: tokens/s of --decode-tokens greedy steps after a short prompt (tg128), or with
--decode-depth N after a prompt of N tokens (its prefill not timed; llama-bench's `-d`): a long
chat's decode, where each token also reads the K and V of every position before it.
Each figure is the best of --repeat runs after one warm-up. Ratios are localllm / other.
Bandwidth: the machine's DRAM read bandwidth (a sum over a --bandwidth-mib buffer, far larger
than the caches, with --threads threads, on 2 MiB pages where the weights are) beside what
decode reads: the bytes of every weight a token reads (the packed projections and the LM head,
norms; not the embedding rows) and of the cached K and V it attends to (at --decode-depth, the
mean context of the decode run) times decode tokens/s, and their ratio (target >= 80%). A
shared machine's bandwidth moves within seconds, so it is measured just before each decode
run, and each run is compared with its own measurement: the median of those ratios (and their
range) is reported.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from llama_ref import in_child, open_llama  # noqa: E402

from localllm import LLM, CacheConfig, SamplingParams  # noqa: E402
from localllm.backends.cpu import weight_arena  # noqa: E402
from localllm.backends.cpu.dispatch import native_kernels  # noqa: E402
from localllm.config import SchedulerConfig  # noqa: E402
from localllm.engine.model_runner import kv_bytes_per_token  # noqa: E402
from localllm.kernels import cpu_native  # noqa: E402
from localllm.layers.linear import LinearBase, QuantLinear  # noqa: E402
from localllm.machine import cpu_model  # noqa: E402
from localllm.model_path import resolve_model  # noqa: E402

SEED_TEXT = ("The quick brown fox jumps over the lazy dog while the committee debates the budget "
             "for the new library, and children read stories about dragons and distant stars. ")


def prompt_ids(llm: LLM, n: int) -> list[int]:
    ids = llm.encode(SEED_TEXT * (n // 20 + 2))
    return ids[:n]


def peak_rss_mib() -> float:
    """This process's peak resident memory (VmHWM: unlike ru_maxrss, not inherited from the
    parent of a spawned child)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_mib() -> float:
    """This process's resident memory now (VmRSS)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def rss_parts_mib() -> tuple[float, float]:
    """(anonymous, file-backed) resident memory now: the process's own data vs pages of
    mapped files, mostly the code of shared libraries (libtorch) touched on first use. The KV
    pool is a shared anonymous map, counted in neither (RssShmem)."""
    parts = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("RssAnon:", "RssFile:")):
                parts[line.split(":")[0]] = int(line.split()[1]) / 1024
    return parts.get("RssAnon", 0.0), parts.get("RssFile", 0.0)


def kv_blocks_touched(llm: LLM) -> int:
    """KV blocks ever written (resident in the pool's memory map): never-used blocks leave the
    free queue first, in id order, and freed ones return to its end."""
    bm = llm.engine.bm
    keys = list(bm.free_ids)
    untouched = 0
    while untouched < len(keys) and keys[untouched] == keys[0] + untouched:
        untouched += 1
    if untouched and keys[untouched - 1] != bm.num_blocks - 1:
        untouched = 0  # that run was recycled blocks, not the never-used tail
    return bm.num_blocks - untouched


_BW_BUF: list[torch.Tensor] = []  # the child's buffer


def _bw_init(mib: int, threads: int) -> None:
    torch.set_num_threads(threads)
    n = mib * 2**20
    if weight_arena.enabled():
        # on 2 MiB pages, as the packed weights decode reads (2-4% faster to sum than 4 KiB
        # pages here), so that both sides of the ratio read memory the same way
        buf = weight_arena.huge_page_buffer(n)[0].view(torch.float32)
    else:
        buf = torch.empty(n // 4, dtype=torch.float32)
    buf.fill_(1.0)  # pages faulted in
    _BW_BUF.append(buf)


def _bw_measure(repeat: int) -> float:
    buf = _BW_BUF[0]
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t)
    return buf.numel() * 4 / best / 1e9


class ReadBandwidth:
    """DRAM read bandwidth in GB/s, on call: the best of `repeat` sums over a buffer of `mib`
    MiB with `threads` threads, in a child process that holds the buffer (so that it stays out
    of this process's memory figures) and waits between calls."""

    def __init__(self, mib: int, threads: int) -> None:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        self._pool.submit(_bw_init, mib, threads).result()

    def __call__(self, repeat: int = 3) -> float:
        return float(self._pool.submit(_bw_measure, repeat).result())

    def close(self) -> None:
        self._pool.shutdown()


def decode_bytes_per_token(model: torch.nn.Module) -> int:
    """Weight bytes one decode token reads: every linear layer's weight once (a tied LM head
    counts once, as the head; an untied embedding table is only indexed, so it is left out)
    and the other parameters (norms)."""
    embed = getattr(model, "embed_tokens", None)
    tied = embed is not None and getattr(model, "lm_head", None) is embed
    seen: set[int] = set()
    total = 0
    for mod in model.modules():
        if id(mod) in seen or (mod is embed and not tied):
            continue
        seen.add(id(mod))
        if isinstance(mod, QuantLinear):
            total += mod.qweight.nbytes + sum(p.numel() * p.element_size()
                                              for p in mod.parameters(recurse=False))
        elif isinstance(mod, LinearBase) or not list(mod.children()):
            total += sum(p.numel() * p.element_size() for p in mod.parameters(recurse=False))
    return total


def bench_localllm(path: Path, dtype: str, n_prompt: int, n_decode: int, repeat: int,
                   depth: int = 0, bandwidth: ReadBandwidth | None = None) -> dict[str, float]:
    base = rss_mib()
    base_anon, base_file = rss_parts_mib()
    anon_peak = 0.0

    def sample() -> None:
        nonlocal anon_peak
        anon_peak = max(anon_peak, rss_parts_mib()[0] - base_anon)

    t0 = time.perf_counter()
    # no prefix cache on disk: a prompt stored by an earlier run would not be prefilled
    llm = LLM(path, dtype=dtype, cache=CacheConfig(prefix_cache=False),
              scheduler=SchedulerConfig(max_num_batched_tokens=max(n_prompt, 512), max_num_seqs=1))
    load = time.perf_counter() - t0
    sample()
    llm.generate([llm.encode("Hello")], SamplingParams(max_tokens=1, temperature=0))
    first_token = time.perf_counter() - t0
    ids = prompt_ids(llm, max(n_prompt, depth))
    pp = []
    vocab = llm.config.vocab_size
    for i in range(repeat + 1):
        # a different first token each time, so the prefix cache cannot serve the prompt
        fresh = [(ids[0] + 1 + i) % vocab] + ids[1:n_prompt]
        t = time.perf_counter()
        llm.generate([fresh], SamplingParams(max_tokens=1, temperature=0))
        pp.append(time.perf_counter() - t)
        sample()
    tg = []
    bw = []  # the read bandwidth just before each decode run
    short = ids[:depth or 8]
    for _ in range(repeat + 1):
        bw.append(bandwidth() if bandwidth is not None else 0.0)
        out = llm.generate([short], SamplingParams(max_tokens=n_decode, temperature=0,
                                                   ignore_eos=True))[0]
        times = out.times.token_times
        tg.append((times[-1] - times[0]) / (len(times) - 1))
        sample()
    kv_bytes = kv_bytes_per_token(llm.config, llm.engine.runner.model.dtype)
    # a decode step also reads the K and V of its context: the run's mean
    context = len(short) + n_decode / 2
    return {"decode_bytes_per_token": decode_bytes_per_token(llm.engine.runner.model)
            + context * kv_bytes,
            "decode_runs_tok_s": [1 / t for t in tg[1:]],  # type: ignore[dict-item]
            "decode_runs_read_gbs": bw[1:],  # type: ignore[dict-item]
            "load_s": load, "load_to_first_token_s": first_token,
            "prefill_tok_s": n_prompt / min(pp[1:]), "decode_tok_s": 1 / min(tg[1:]),
            "peak_rss_mib": peak_rss_mib(), "baseline_rss_mib": base,
            "anon_above_baseline_mib": anon_peak,
            "file_pages_above_baseline_mib": rss_parts_mib()[1] - base_file,
            "kv_used_mib": kv_blocks_touched(llm) * llm.engine.block_size * kv_bytes / 2**20,
            "ids": ids}


def bench_llama_cpp(path: Path, threads: int, n_prompt: int, n_decode: int,
                    repeat: int, ids: list[int], depth: int = 0) -> dict[str, float]:
    import numpy as np

    t0 = time.perf_counter()
    llm = open_llama(path, n_ctx=n_prompt + n_decode + 16, n_threads=threads, n_batch=n_prompt)
    # logits of every position are needed only to pick greedy tokens while decoding
    dec = open_llama(path, n_ctx=max(n_prompt, depth) + n_decode + 16, n_threads=threads,
                     n_batch=max(depth, 8), logits_all=True)
    load = time.perf_counter() - t0
    pp = []
    for _ in range(repeat + 1):
        llm.reset()
        t = time.perf_counter()
        llm.eval(ids[:n_prompt])
        pp.append(time.perf_counter() - t)
    tg = []
    for _ in range(repeat + 1):
        dec.reset()
        dec.eval(ids[:depth or 8])
        t = time.perf_counter()
        for _ in range(n_decode):
            tok = int(np.argmax(dec.scores[dec.n_tokens - 1]))
            dec.eval([tok])
        tg.append((time.perf_counter() - t) / n_decode)
    return {"load_s": load, "prefill_tok_s": n_prompt / min(pp[1:]),
            "decode_tok_s": 1 / min(tg[1:]), "peak_rss_mib": peak_rss_mib()}


def bench_transformers(path: Path, threads: int, n_prompt: int, n_decode: int, repeat: int,
                       ids: list[int]) -> dict[str, float]:
    import transformers

    torch.set_num_threads(threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.bfloat16).eval()
    x = torch.tensor([ids])
    pp = []
    with torch.no_grad():
        for _ in range(repeat + 1):
            t = time.perf_counter()
            model(x)
            pp.append(time.perf_counter() - t)
        tg = []
        for _ in range(repeat + 1):
            t = time.perf_counter()
            model.generate(x[:, :8], max_new_tokens=n_decode, min_new_tokens=n_decode,
                           do_sample=False)
            tg.append((time.perf_counter() - t) / n_decode)
    return {"prefill_tok_s": n_prompt / min(pp[1:]), "decode_tok_s": 1 / min(tg[1:]),
            "peak_rss_mib": peak_rss_mib()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--decode-depth", type=int, default=0,
                    help="decode after a prompt of this many tokens (default: 8)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--transformers", action="store_true", help="also run transformers bf16")
    ap.add_argument("--bandwidth-mib", type=int, default=1024,
                    help="buffer size of the read-bandwidth measurement (0: skip it)")
    ap.add_argument("--json", default=None, help="write results to this file")
    args = ap.parse_args()
    if args.decode_depth and args.transformers:
        ap.error("--decode-depth is measured in localllm and llama.cpp only: drop --transformers")
    torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    results: dict[str, dict[str, float]] = {}
    depth = f" @ d{args.decode_depth}" if args.decode_depth else ""
    print(f"model {path.name}, {args.threads} threads, pp{args.prompt_tokens} / "
          f"tg{args.decode_tokens}{depth}, native kernels: {native_kernels()}", file=sys.stderr)
    bandwidth = ReadBandwidth(args.bandwidth_mib, args.threads) if args.bandwidth_mib else None
    try:
        results["localllm"] = bench_localllm(path, args.dtype, args.prompt_tokens,
                                             args.decode_tokens, args.repeat,
                                             args.decode_depth, bandwidth)
    finally:
        if bandwidth is not None:
            bandwidth.close()
    ids = results["localllm"].pop("ids")  # type: ignore[assignment]
    try:
        # each reference runs in its own process: llama.cpp's and torch's OpenMP thread pools
        # slow each other down many times over in one process, and peak memory stays apart
        results["llama.cpp"] = in_child(bench_llama_cpp, path, args.threads,
                                        args.prompt_tokens, args.decode_tokens, args.repeat, ids,
                                        args.decode_depth)
    except ImportError:
        print("llama-cpp-python is not installed: skipping llama.cpp", file=sys.stderr)
    if args.transformers:
        results["transformers-bf16"] = in_child(bench_transformers, path, args.threads,
                                                args.prompt_tokens, args.decode_tokens,
                                                args.repeat, ids)
    ours = results["localllm"]
    per_token = ours["decode_bytes_per_token"]
    runs = list(zip(ours["decode_runs_tok_s"], ours["decode_runs_read_gbs"]))  # type: ignore
    ratios = sorted(per_token * tok / 1e9 / gbs for tok, gbs in runs if gbs)
    if ratios:
        ours["read_bandwidth_gbs"] = statistics.median(g for _, g in runs)
        ours["decode_bandwidth_ratio"] = statistics.median(ratios)
    print(f"{'system':<20}{'prefill tok/s':>15}{'decode tok/s':>15}{'peak MiB':>10}"
          f"{'ours/pp':>9}{'ours/tg':>9}")
    for name, r in results.items():
        print(f"{name:<20}{r['prefill_tok_s']:>15.1f}{r['decode_tok_s']:>15.1f}"
              f"{r['peak_rss_mib']:>10.0f}"
              f"{ours['prefill_tok_s'] / r['prefill_tok_s']:>9.2f}"
              f"{ours['decode_tok_s'] / r['decode_tok_s']:>9.2f}")
    print(f"CPU: {cpu_model()}")
    print(f"localllm: load {ours['load_s']:.2f} s, load to first token "
          f"{ours['load_to_first_token_s']:.2f} s, peak RSS {ours['peak_rss_mib']:.0f} MiB "
          f"({args.dtype})")
    if ratios:
        print(f"bandwidth: read {ours['read_bandwidth_gbs']:.1f} GB/s, median of the "
              f"{len(runs)} decode runs' ({min(g for _, g in runs):.1f}-"
              f"{max(g for _, g in runs):.1f}; {args.bandwidth_mib} MiB sums, {args.threads} "
              f"threads, just before each run); decode reads {per_token / 1e6:.1f} MB/token")
        for tok, gbs in runs:
            print(f"  run: {tok:.1f} tok/s = {per_token * tok / 1e9:.1f} GB/s of {gbs:.1f} GB/s "
                  f"= {per_token * tok / 1e9 / gbs:.0%}")
        print(f"  decode / read bandwidth: median {ours['decode_bandwidth_ratio']:.0%} "
              f"({ratios[0]:.0%}-{ratios[-1]:.0%}; target >= 80%)")
    file_mib = path.stat().st_size / 2**20
    model_peak = ours["peak_rss_mib"] - ours["baseline_rss_mib"]
    print(f"localllm memory: file {file_mib:.0f} MiB; peak above the process with torch "
          f"imported ({ours['baseline_rss_mib']:.0f} MiB) {model_peak:.0f} MiB = "
          f"{model_peak / file_mib:.2f}x the file; KV in use about {ours['kv_used_mib']:.0f} "
          f"MiB (prefix-cached prompts included); target < 1.5x file + KV = "
          f"{1.5 * file_mib + ours['kv_used_mib']:.0f} MiB")
    anon = ours["anon_above_baseline_mib"]
    print(f"  split: the process's own memory (weights, tokenizer, modules, heap; highest after "
          f"load and after each run) {anon:.0f} MiB = {anon / file_mib:.2f}x the file; the KV "
          f"pool (a shared anonymous map) {ours['kv_used_mib']:.0f} MiB; pages of mapped files "
          f"(library code touched on first use) {ours['file_pages_above_baseline_mib']:.0f} MiB")
    if args.json:
        meta = {"machine": platform.processor() or platform.machine(), "cpu": cpu_model(),
                "native_isa": cpu_native.isa(), "amx_decode": cpu_native.amx_mode(),
                "cpus": torch.get_num_threads(), "torch": torch.__version__,
                "python": platform.python_version(), "model": path.name,
                "decode_depth": args.decode_depth}
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=2))


if __name__ == "__main__":
    main()
