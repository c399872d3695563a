"""The Triton backend on a CUDA GPU: kernel tests compiled, each kernel timed against its
baseline, and the engine end to end; a table on stdout, JSON under $OUT (or --out).

    python benchmarks/gpu_check.py                  # on a CUDA machine: the whole check
    TRITON_INTERPRET=1 python benchmarks/gpu_check.py --tiny   # tiny shapes on the CPU (tests)

Sections (each timed with `triton.testing.do_bench` on a GPU, median ms):

1. device: name, torch and triton versions, measured copy bandwidth (a 1 GiB device-to-device
   copy, bytes read + written / time): the bound every "fraction of bandwidth" below divides by.
2. kernel tests: `pytest tests/kernels` compiled (TRITON_INTERPRET unset), pass/fail counts.
3. quantized matmul: int4 (Q4_0-like, groups of 32) at the projections of 1B- and 8B-shaped
   models (qkv, o, gate_up, down), M = 1 (decode GEMV), 8, 512 (prefill), against fp16
   `F.linear` on the dense weight and bitsandbytes NF4 (`bnb.matmul_4bit`) where installed;
   achieved bandwidth of the GEMV = packed weight bytes / time. Target: int4 GEMV at M = 1 at
   least 3x faster than fp16 (Marlin's ideal is 3.87x).
4. paged attention: decode over an 8k context (batch 1 and 8, 32 query / 8 KV heads, head_dim
   128) against SDPA on a contiguous cache; achieved bandwidth = K/V bytes read / time (target
   70% of copy bandwidth); extend (a 512-token chunk after 4k cached) against SDPA with a mask.
5. end to end: the default model (when installed; with and without CUDA graphs) and a synthetic
   1B-shaped int4 model (random weights, the default model's tokenizer): batch-1 and batch-8
   decode tokens/s, prefill tokens/s of a 512-token prompt, TTFT; batch-1 decode as a fraction
   of its bandwidth bound (copy bandwidth / bytes one step reads: every weight once, plus the
   K/V in use). Target 80%.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from localllm.loader import LoadedModel
    from localllm.quant.formats import Int4Weight

ROOT = Path(__file__).resolve().parents[1]

# (hidden, intermediate, heads, kv heads, head_dim, layers) of the model shapes the kernels meet
SHAPES = {"1B": (2048, 8192, 32, 8, 64, 16), "8B": (4096, 14336, 32, 8, 128, 32)}
TINY = {"tiny": (64, 128, 4, 2, 16, 2)}


def bench(fn: Callable[[], object], device: torch.device) -> float:
    """Median milliseconds of one call of `fn`."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100))
    fn()
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes a second of a device-to-device copy (read + write)."""
    src = torch.empty(nbytes // 2, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src), device)
    return 2 * nbytes / (ms / 1e3)


def random_int4(out: int, inp: int, device: torch.device) -> Int4Weight:
    from localllm.quant.formats import Int4Weight

    q = torch.randint(0, 256, (out, inp // 2), dtype=torch.uint8, device=device)
    s = (torch.rand(out, inp // 32, device=device) * 0.02 + 0.001).half()
    return Int4Weight(q, s, None, 32)


def matmul_rows(device: torch.device, shapes: dict[str, tuple[int, ...]],
                ms_rows: tuple[int, ...], bw: float) -> list[dict[str, Any]]:
    from localllm.backends.triton.weights import to_qmatrix
    from localllm.kernels import triton_qmatmul

    try:
        import bitsandbytes as bnb
        import bitsandbytes.functional as bnb_f
    except Exception:  # not installed, or no GPU backend
        bnb = None
    rows = []
    dt = torch.float16 if device.type == "cuda" else torch.float32
    for model, (hidden, inter, heads, kv, hd, _) in shapes.items():
        mats = {"qkv": ((heads + 2 * kv) * hd, hidden), "o": (hidden, heads * hd),
                "gate_up": (2 * inter, hidden), "down": (hidden, inter)}
        for name, (n, k) in mats.items():
            w = random_int4(n, k, device)
            qm = to_qmatrix(w, device)
            dense = w.dequantize().to(dt)
            nf4 = None
            if bnb is not None and device.type == "cuda":
                nf4 = bnb_f.quantize_4bit(dense, blocksize=64, quant_type="nf4")
            for m in ms_rows:
                x = torch.randn(m, k, device=device).to(dt)
                t_q = bench(partial(triton_qmatmul.qmatmul, x, qm), device)
                t_d = bench(partial(F.linear, x, dense), device)
                row = {"model": model, "matrix": name, "N": n, "K": k, "M": m,
                       "int4_ms": t_q, "fp16_ms": t_d, "speedup_vs_fp16": t_d / t_q,
                       "int4_GBps": qm.nbytes / (t_q / 1e3) / 1e9,
                       "int4_frac_of_copy_bw": qm.nbytes / (t_q / 1e3) / bw}
                if nf4 is not None:
                    qw, state = nf4
                    t_n = bench(partial(bnb.matmul_4bit, x, qw.t(), quant_state=state),
                                device)
                    row["bnb_nf4_ms"] = t_n
                    row["speedup_vs_bnb_nf4"] = t_n / t_q
                rows.append(row)
    return rows


def _pool(b: int, ctx: int, kv: int, hd: int, bs: int, device: torch.device, dt: torch.dtype
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K/V pools holding `b` sequences of `ctx` tokens in shuffled blocks, and their tables."""
    per = -(-ctx // bs)
    nb = b * per + 1
    k = torch.randn(nb, bs, kv, hd, device=device).to(dt)
    v = torch.randn(nb, bs, kv, hd, device=device).to(dt)
    tables = torch.randperm(nb - 1, device=device)[:b * per].view(b, per).to(torch.int32)
    return k, v, tables


def attention_rows(device: torch.device, ctx: int, chunk: int, heads: int, kv: int, hd: int,
                   bw: float) -> list[dict[str, Any]]:
    from localllm.kernels import triton_decode_attention, triton_extend_attention

    dt = torch.float16 if device.type == "cuda" else torch.float32
    bs, rows = 16, []
    scale = hd ** -0.5
    for b in (1, 8):
        k, v, tables = _pool(b, ctx, kv, hd, bs, device, dt)
        lens = torch.full((b,), ctx, dtype=torch.int32, device=device)
        q = torch.randn(b, heads, hd, device=device).to(dt)
        t_p = bench(partial(triton_decode_attention.paged_decode_attention, q, k, v, tables,
                            lens, scale), device)
        kc = torch.randn(b, kv, ctx, hd, device=device).to(dt)  # contiguous cache
        vc = torch.randn_like(kc)
        qs = q[:, :, None]  # [b, heads, 1, hd]
        t_s = bench(partial(F.scaled_dot_product_attention, qs, kc, vc, scale=scale,
                            enable_gqa=True), device)
        kv_bytes = 2 * b * ctx * kv * hd * k.element_size()
        rows.append({"op": "decode", "batch": b, "context": ctx, "paged_ms": t_p,
                     "sdpa_contiguous_ms": t_s, "GBps": kv_bytes / (t_p / 1e3) / 1e9,
                     "frac_of_copy_bw": kv_bytes / (t_p / 1e3) / bw})
    k, v, tables = _pool(1, ctx + chunk, kv, hd, bs, device, dt)
    q = torch.randn(chunk, heads, hd, device=device).to(dt)
    starts = torch.tensor([0, chunk], dtype=torch.int32, device=device)
    lens = torch.tensor([ctx + chunk], dtype=torch.int32, device=device)
    t_e = bench(lambda: triton_extend_attention.paged_extend_attention(
        q, k, v, tables, starts, lens, scale), device)
    kc = torch.randn(1, kv, ctx + chunk, hd, device=device).to(dt)
    mask = (torch.arange(ctx + chunk, device=device)[None, :]
            <= torch.arange(ctx, ctx + chunk, device=device)[:, None])
    t_s = bench(lambda: F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], kc, kc, attn_mask=mask, scale=scale, enable_gqa=True), device)
    rows.append({"op": "extend", "batch": 1, "context": ctx, "chunk": chunk, "paged_ms": t_e,
                 "sdpa_contiguous_ms": t_s})
    return rows


def synthetic_model(shape: tuple[int, ...], device: torch.device,
                    tokenizer_path: Path) -> LoadedModel:
    """A LoadedModel of `shape` with random int4 projections and the default model's tokenizer
    (its vocabulary sizes the embedding)."""
    from localllm.backends import make_backend
    from localllm.config import ModelConfig
    from localllm.gguf.reader import GGUFFile
    from localllm.layers.linear import Linear, replace_module, row_source
    from localllm.loader import LoadedModel
    from localllm.models.llama import LlamaForCausalLM
    from localllm.text.tokenizer import Tokenizer

    hidden, inter, heads, kv, hd, layers = shape
    tok = Tokenizer.from_gguf_metadata(GGUFFile(tokenizer_path).metadata,
                                       source=str(tokenizer_path))
    cfg = ModelConfig(arch="llama", vocab_size=tok.vocab_size, hidden_size=hidden,
                      intermediate_size=inter, num_layers=layers, num_heads=heads,
                      num_kv_heads=kv, head_dim=hd, rms_norm_eps=1e-5, rope_theta=500000.0,
                      rope_dim=hd, context_length=8192, rope_neox=False,
                      tie_word_embeddings=True, name=f"synthetic {hidden}x{layers} int4")
    backend = make_backend(device.type, "triton")
    with torch.device(device):
        model = LlamaForCausalLM(cfg, torch.bfloat16, backend)
    with torch.no_grad():
        model.embed_tokens.dense_weight().normal_(0, 0.02)
        for name, module in list(model.named_modules()):
            if isinstance(module, Linear) and name.endswith("proj"):
                packed = module.pack(row_source(random_int4(module.out_features,
                                                            module.in_features, device)))
                assert packed is not None
                replace_module(model, module, packed)
    model.fuse_projections()
    return LoadedModel(model, tok, cfg, tokenizer_path, f"synthetic-{hidden}-{layers}", backend)


def engine_rows(loaded: LoadedModel, label: str, prompt_tokens: int, decode_tokens: int,
                bw: float) -> dict[str, Any]:
    """Batch-1 / batch-8 decode, prefill and TTFT of one model through the engine."""
    from localllm.config import CacheConfig, SamplingParams, SchedulerConfig
    from localllm.engine.engine import LLMEngine
    from localllm.engine.request import Request
    from localllm.layers.linear import QuantLinear

    # no prefix store: a prompt stored by an earlier run would spoil the cold prefill figure
    eng = LLMEngine(loaded, CacheConfig(prefix_cache=False),
                    SchedulerConfig(max_num_batched_tokens=max(prompt_tokens, 512)))
    vocab = loaded.tokenizer.vocab_size
    params = SamplingParams(max_tokens=decode_tokens, temperature=0, ignore_eos=True)

    def run(prompts: list[list[int]]) -> list[Request]:
        reqs = [eng.add_request(p, params) for p in prompts]
        while eng.has_unfinished():
            eng.step()
        return reqs

    run([[1, 2, 3, 4]])  # warm-up (Triton compiles its kernels here)
    res: dict[str, Any] = {"model": label}
    for b in (1, 8):
        reqs = run([[5 + i, 6, 7, 8] for i in range(b)])
        start = max(r.times.token_times[0] for r in reqs)
        end = max(r.times.token_times[-1] for r in reqs)
        n = sum(sum(1 for t in r.times.token_times if t > start) for r in reqs)
        res[f"decode_tok_s@{b}"] = n / (end - start)
    prompt = [(7 * i + 3) % vocab for i in range(prompt_tokens)]
    req = run([prompt])[0]
    ttft = req.times.ttft or float("nan")
    res["ttft_ms"] = 1e3 * ttft
    res["prefill_tok_s"] = prompt_tokens / ttft
    weights = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    weights += sum(m.qweight.nbytes for m in loaded.model.modules()
                   if isinstance(m, QuantLinear))
    cfg = loaded.config
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2 * (4 + decode_tokens // 2)
    bound = bw / (weights + kv)
    res["weight_bytes"] = weights
    res["bandwidth_bound_tok_s@1"] = bound
    res["frac_of_bound@1"] = res["decode_tok_s@1"] / bound
    return res


def kernel_tests(timeout: int) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    try:
        p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            "tests/kernels"], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"ok": False, "summary": f"timed out after {timeout} s"}
    lines = [line for line in p.stdout.strip().splitlines() if line.strip()]
    return {"ok": p.returncode == 0, "summary": lines[-1] if lines else p.stderr[-400:]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for the JSON")
    ap.add_argument("--tiny", action="store_true",
                    help="tiny shapes, no kernel tests, the end-to-end part on a tiny synthetic "
                    "model only (the CPU check)")
    ap.add_argument("--skip-tests", action="store_true", help="skip the compiled kernel tests")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and not args.tiny:
        print("gpu_check: no CUDA GPU here; run with --tiny (and TRITON_INTERPRET=1) for the "
              "CPU check", file=sys.stderr)
        return 2
    device = torch.device("cuda" if cuda else "cpu")
    import triton

    name = torch.cuda.get_device_name() if cuda else "cpu (interpreter)"
    report: dict[str, Any] = {"device": name, "torch": torch.__version__,
                              "triton": triton.__version__}
    bw = copy_bandwidth(device, (1 << 30) if cuda else (1 << 20))
    report["copy_GBps"] = bw / 1e9
    print(f"{report['device']}: copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    if not args.tiny and not args.skip_tests:
        report["kernel_tests"] = kernel_tests(timeout=240)
        print(f"kernel tests (compiled): {report['kernel_tests']['summary']}", flush=True)
    shapes = TINY if args.tiny else SHAPES
    report["matmul"] = matmul_rows(device, shapes, (1, 8) if args.tiny else (1, 8, 512), bw)
    print(f"\n{'model':<6}{'matrix':<9}{'M':>5}{'int4 ms':>10}{'fp16 ms':>10}{'x fp16':>8}"
          f"{'% copy bw':>11}")
    for r in report["matmul"]:
        print(f"{r['model']:<6}{r['matrix']:<9}{r['M']:>5}{r['int4_ms']:>10.4f}"
              f"{r['fp16_ms']:>10.4f}{r['speedup_vs_fp16']:>8.2f}"
              f"{100 * r['int4_frac_of_copy_bw']:>10.0f}%")
    hidden, _, heads, kv, hd, _ = next(iter(shapes.values()))
    ctx, chunk = (40, 8) if args.tiny else (8192, 512)
    report["attention"] = attention_rows(device, ctx, chunk, heads, kv,
                                         hd if args.tiny else 128, bw)
    print(f"\n{'attention':<10}{'batch':>6}{'context':>8}{'paged ms':>10}{'sdpa ms':>10}"
          f"{'% copy bw':>11}")
    for r in report["attention"]:
        frac = f"{100 * r['frac_of_copy_bw']:.0f}%" if "frac_of_copy_bw" in r else ""
        print(f"{r['op']:<10}{r['batch']:>6}{r['context']:>8}{r['paged_ms']:>10.4f}"
              f"{r['sdpa_contiguous_ms']:>10.4f}{frac:>11}")
    from localllm.model_path import default_model_path

    report["engine"] = []
    default = default_model_path()
    if args.tiny and default is not None:  # the synthetic model's path, at a tiny shape
        report["engine"].append(engine_rows(synthetic_model(TINY["tiny"], device, default),
                                            "synthetic tiny int4", 16, 4, bw))
    if not args.tiny:
        if default is not None:
            from localllm.backends import make_backend
            from localllm.loader import load_gguf

            loaded = load_gguf(default, torch.bfloat16, backend=make_backend("cuda", "triton"))
            report["engine"].append(engine_rows(loaded, default.name, 512, 128, bw))
            os.environ["LOCALLLM_CUDA_GRAPHS"] = "0"  # read when the engine's runner is built
            report["engine"].append(engine_rows(loaded, default.name + " (no CUDA graphs)",
                                                512, 128, bw))
            del os.environ["LOCALLLM_CUDA_GRAPHS"]
            report["engine"].append(engine_rows(synthetic_model(SHAPES["1B"], device, default),
                                                "synthetic 1B int4", 512, 128, bw))
    if report["engine"]:
        print(f"\n{'model':<34}{'tg@1':>8}{'tg@8':>8}{'prefill':>9}{'TTFT ms':>9}{'% bound':>9}")
        for r in report["engine"]:
            print(f"{r['model']:<34}{r['decode_tok_s@1']:>8.1f}{r['decode_tok_s@8']:>8.1f}"
                  f"{r['prefill_tok_s']:>9.0f}{r['ttft_ms']:>9.1f}"
                  f"{100 * r['frac_of_bound@1']:>8.0f}%")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2))
    print(f"\nJSON: {out / 'gpu_check.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
