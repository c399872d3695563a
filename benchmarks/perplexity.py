"""Perplexity of localllm's compute modes on a fixed text, beside llama.cpp, in one run.

    python benchmarks/perplexity.py [--model PATH] [--tokens 1024] [--text FILE]

Modes: fp32 (weights dequantized exactly: the reference of the file's own weights), bf16 with
int4 weights kept packed (the fast CPU path: one token a step, as decode runs it -- with the
native kernels, the whole step in one call; 16 and 512 tokens at a time, as prompt chunks run;
and one prefill of the whole text), bf16 with every weight dense. The text defaults to
the Apache License 2.0 (benchmarks/data). One window of --tokens tokens; each position is
scored given all the previous ones.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from llama_ref import llama_logits  # noqa: E402

from localllm.engine.model_runner import prompt_logits  # noqa: E402
from localllm.loader import load_gguf  # noqa: E402
from localllm.model_path import find_model  # noqa: E402


def perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    # logits: [T, vocab]; position t predicts ids[t + 1]
    logp = torch.log_softmax(logits[:-1].float(), dim=-1)
    target = torch.tensor(ids[1:])
    nll = -logp.gather(1, target[:, None]).mean().item()
    return math.exp(nll)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--text", default=str(ROOT / "benchmarks" / "data" / "apache-2.0.txt"))
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = find_model(args.model)
    text = Path(args.text).read_text()
    results: dict[str, float] = {}
    ids: list[int] = []
    # chunk 1: decode (the one-call native step); 16: small prompt chunks (AMX tiles on the
    # packed codes where the CPU has them, else the few-rows kernel); 512: the engine's default
    # prompt chunk (int4_gemm with AMX, else dequantize + matmul); whole: one prefill (above 768
    # rows always dequantize + matmul)
    for name, dtype, quantized, chunk in [
            ("localllm fp32 (reference)", torch.float32, False, 0),
            ("localllm bf16 int4, decode", torch.bfloat16, True, 1),
            ("localllm bf16 int4, chunks 16", torch.bfloat16, True, 16),
            ("localllm bf16 int4, chunks 512", torch.bfloat16, True, 512),
            ("localllm bf16 int4, prefill", torch.bfloat16, True, 0),
            ("localllm bf16, dense", torch.bfloat16, False, 0)]:
        loaded = load_gguf(path, dtype, quantized=quantized)
        if not ids:
            ids = loaded.tokenizer.encode(text)[: args.tokens]
        t = time.perf_counter()
        results[name] = perplexity(prompt_logits(loaded.model, ids, chunk=chunk), ids)
        print(f"  {name}: {time.perf_counter() - t:.1f} s", file=sys.stderr)
    try:
        results["llama.cpp"] = perplexity(torch.from_numpy(llama_logits(path, ids)), ids)
    except ImportError:
        print("llama-cpp-python is not installed: skipping llama.cpp", file=sys.stderr)
    ref = results["localllm fp32 (reference)"]
    print(f"{path.name}, {len(ids)} tokens of {Path(args.text).name}")
    print(f"{'mode':<34}{'perplexity':>12}{'vs fp32':>10}")
    for name, ppl in results.items():
        print(f"{name:<34}{ppl:>12.4f}{(ppl / ref - 1) * 100:>+9.2f}%")


if __name__ == "__main__":
    main()
