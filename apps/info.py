"""`localllm info [MODEL]`: a model's architecture, parameters, weight and KV bytes, FLOPs and
bandwidth-bound decode speed, worked out from its file without loading it
(`localllm.model_stats`, `localllm.weight_bytes`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from localllm.apps.arg_types import at_least, byte_size, positive_number
from localllm.errors import ModelLoadError, RequestError


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("info", help="parameters, weight and KV bytes, FLOPs and the "
                       "bandwidth-bound decode speed of a model, from its file",
                       description=__doc__)
    p.add_argument("model_pos", nargs="?", metavar="MODEL",
                   help="GGUF file or Hugging Face folder (same as --model)")
    p.add_argument("--model", "-m", default=None,
                   help="default: $LOCALLLM_MODEL, the config file, then the installed default")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"],
                   help="compute dtype, also the KV cache's (default: bfloat16)")
    p.add_argument("--backend", default="auto", choices=["auto", "cpu", "triton", "torch"],
                   help="backend whose loaded bytes count for the KV fit and the bound "
                   "(auto: triton with a CUDA GPU, else cpu)")
    p.add_argument("--memory", type=byte_size(10**9, "GB"), default=8 * 10**9, metavar="SIZE",
                   help="memory for weights + KV: 16 or 16GB (10^9 bytes), 16G or 16GiB (2^30), "
                   "512M (default: 8GB)")
    p.add_argument("--sessions-at", type=at_least(1), default=0, metavar="N",
                   help="session length for how many concurrent sessions fit (default: 4096, "
                   "or the model's context where shorter)")
    p.add_argument("--context", type=at_least(1), default=0, metavar="N",
                   help="context length for FLOPs and the bandwidth bound (default: the "
                   "model's)")
    bw = p.add_mutually_exclusive_group()
    bw.add_argument("--bandwidth", type=positive_number, default=None, metavar="GB/s",
                    help="memory bandwidth for the decode bound")
    bw.add_argument("--measure", action="store_true",
                    help="measure the bandwidth here (best of 5 copies of a 256 MiB buffer)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")


def _auto_backend(name: str) -> str:
    if name != "auto":
        return name
    import importlib.util

    import torch

    if torch.cuda.is_available():
        return "triton" if importlib.util.find_spec("triton") else "torch"
    return "cpu"


def model_info(path: Path, dtype_name: str, backend: str, memory: int, sessions_at: int,
               context: int, bandwidth: float | None) -> dict[str, Any]:
    """Every figure of `localllm info` as plain values (bytes, counts, FLOPs, bytes/s)."""
    from localllm.config import DTYPES
    from localllm.gguf.config import config_of_file
    from localllm.gguf.reader import GGUFFile
    from localllm.hf.config import config_from_hf
    from localllm.hf.loader import read_config
    from localllm.model_stats import (
        MODULES,
        attended_positions,
        decode_bound,
        decode_flops,
        kv_fit,
        param_counts,
        prefill_flops,
    )
    from localllm.weight_bytes import BACKEND_NAMES, gguf_entries, hf_entries, weight_bytes

    dtype = DTYPES[dtype_name]
    if path.is_dir():
        cfg = config_from_hf(read_config(path))
        entries = hf_entries(path, cfg.tie_word_embeddings)
        fmt = "huggingface"
    else:
        gf = GGUFFile(path)
        cfg = config_of_file(gf)
        entries = gguf_entries(gf)
        fmt = "gguf"
    context = context or cfg.context_length
    sessions_at = sessions_at or min(4096, cfg.context_length)
    if context <= 0 or sessions_at <= 0:
        raise RequestError("--context and --sessions-at must be positive")
    params = {m: sum(e.numel for e in entries if e.module == m) for m in MODULES}
    wb = weight_bytes(entries, dtype)
    loaded = {b: {**wb.loaded[b], "total": wb.loaded_total(b)} for b in BACKEND_NAMES}
    fit = kv_fit(cfg, dtype, memory, wb.loaded_total(backend), sessions_at)
    embed_read = 0 if cfg.tie_word_embeddings else wb.loaded[backend].get("embeddings", 0)
    # K/V read back per step: a sliding-window layer reads at most its window
    kv_read = fit.bytes_per_token * attended_positions(cfg, context) // cfg.num_layers
    step_bytes = wb.loaded_total(backend) - embed_read + kv_read
    out: dict[str, Any] = {
        "model": {"path": str(path), "format": fmt, "name": cfg.name},
        "config": dataclasses.asdict(cfg),
        "params": {**params, "total": sum(params.values()),
                   "from_config": param_counts(cfg)._asdict()},
        "weights": {
            "stored": {q: {"tensors": n, "params": p, "bytes": b}
                       for q, (n, p, b) in sorted(wb.stored.items())},
            "stored_total": wb.stored_total, "dtype": dtype_name, "loaded": loaded},
        "kv": {"dtype": dtype_name, "backend": backend, "memory": memory,
               **fit._asdict(), "session_len": sessions_at},
        "flops": {"context": context, "prefill": prefill_flops(cfg, context)._asdict(),
                  "decode": decode_flops(cfg, context)._asdict()},
        "bandwidth": {"backend": backend, "context": context, "bytes_per_step": step_bytes,
                      "bytes_per_s": bandwidth,
                      "decode_tokens_per_s": None if bandwidth is None
                      else decode_bound(step_bytes, bandwidth)},
    }
    return out


def _mib(n: float) -> str:
    return f"{n / 2**20:,.2f} MiB"


def _memory(n: int) -> str:
    """--memory as given: decimal units (8 GB, 0.512 GB), binary ones (16 GiB), else bytes."""
    if n % 10**6 == 0:
        return f"{n / 1e9:g} GB"
    if n % 2**20 == 0:
        return f"{n / 2**30:g} GiB"
    return f"{n:,} bytes"


def _count(n: float) -> str:
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f}{suffix}"
    return f"{n:.0f}"


def render(info: dict[str, Any]) -> str:
    from localllm.model_stats import MODULES

    c, p, w, kv, f, bw = (info[k] for k in ("config", "params", "weights", "kv", "flops",
                                              "bandwidth"))
    theta = c["rope_theta"]
    lines = [" ".join(filter(None, (info["model"]["path"], f"({info['model']['format']})",
                                    c["name"]))),
             f"architecture  {c['arch']}: {c['num_layers']} layers, hidden {c['hidden_size']}, "
             f"{c['num_heads']} heads / {c['num_kv_heads']} KV heads of {c['head_dim']}, "
             f"MLP {c['intermediate_size']}, vocab {c['vocab_size']}, context "
             f"{c['context_length']:,}, RoPE base "
             f"{f'{int(theta):,}' if float(theta).is_integer() else f'{theta:g}'}"
             f"{', tied head' if c['tie_word_embeddings'] else ''}",
             "", f"parameters    {p['total']:,} ({_count(p['total'])})"]
    for m in MODULES:
        note = " (tied: counted in embeddings)" if m == "head" and c["tie_word_embeddings"] else ""
        lines.append(f"  {m:<12}{p[m]:>14,}{note}")
    lines += ["", f"weights as stored  {_mib(w['stored_total'])}"]
    for q, s in w["stored"].items():
        lines.append(f"  {q:<10}{s['tensors']:>5} tensors {s['params']:>14,} params "
                     f"{_mib(s['bytes']):>14}")
    lines.append(f"weights as loaded ({w['dtype']} compute)")
    for b, mods in w["loaded"].items():
        parts = ", ".join(f"{m} {mods[m] / 2**20:.2f}" for m in MODULES if m in mods)
        lines.append(f"  {b:<8}{_mib(mods['total']):>14}  ({parts} MiB)")
    lines += ["", f"KV cache      {kv['bytes_per_token']:,} bytes/token ({kv['dtype']}); in "
              f"{_memory(kv['memory'])} beside the {kv['backend']} weights: "
              f"{kv['tokens']:,} tokens, one session up to {kv['context']:,}, "
              f"{kv['sessions']:,} sessions of {kv['session_len']:,}"]
    pre, dec = f["prefill"], f["decode"]
    lines += [f"FLOPs/token   at context {f['context']:,}: prefill {_count(pre['total'])} "
              f"(attention {_count(pre['attention'])}), decode {_count(dec['total'])} "
              f"(linear {_count(dec['linear'])}, head {_count(dec['head'])}, attention "
              f"{_count(dec['attention'])})"]
    bound = (f"{bw['decode_tokens_per_s']:,.0f} tokens/s at {bw['bytes_per_s'] / 1e9:.1f} GB/s"
             if bw["bytes_per_s"] else "give --bandwidth GB/s or --measure")
    lines.append(f"decode bound  {_mib(bw['bytes_per_step'])} read per token ({bw['backend']}, "
                 f"context {bw['context']:,}): {bound}")
    return "\n".join(lines)


def cmd_info(args: argparse.Namespace) -> int:
    from localllm.model_path import find_model
    from localllm.model_stats import measure_bandwidth

    if args.model_pos and args.model and args.model_pos != args.model:
        raise RequestError("give the model once: as MODEL or with --model")
    if args.model_pos:  # find_model's message would say "given with --model"
        path = Path(args.model_pos).expanduser()
        if not path.exists():
            raise ModelLoadError(f"{path}: no such file (given as MODEL)")
    else:
        path = find_model(args.model)
    bandwidth = args.bandwidth * 1e9 if args.bandwidth else None
    if args.measure:
        bandwidth = measure_bandwidth()
    info = model_info(path, args.dtype, _auto_backend(args.backend), args.memory,
                      args.sessions_at, args.context, bandwidth)
    info["bandwidth"]["source"] = ("measured" if args.measure else
                                   "given" if bandwidth else None)
    print(json.dumps(info, indent=2) if args.json else render(info))
    return 0
