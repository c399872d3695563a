"""The `localllm` console script."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import TYPE_CHECKING

from localllm.apps.arg_types import GIB, at_least, byte_size
from localllm.apps.cache import add_store_args, cache_config
from localllm.apps.connect import add_endpoint_args
from localllm.apps.sampling_args import add_sampling_args, sampling_params
from localllm.errors import LocalLLMError

if TYPE_CHECKING:  # the functions below import them when called
    from localllm.config import SamplingParams
    from localllm.llm import LLM


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", help="GGUF file or Hugging Face checkpoint folder "
                   "(default: $LOCALLLM_MODEL, the config "
                   "file, then the installed default model)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"],
                   help="compute dtype (default: bfloat16)")
    p.add_argument("--quantize", default=None, choices=["int8", "int4", "nf4"],
                   help="quantize a Hugging Face checkpoint's linear weights on load")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="where the model runs: auto takes a CUDA GPU when PyTorch sees one, "
                   "else the CPU (default: auto)")
    p.add_argument("--backend", default="auto", choices=["auto", "cpu", "triton", "torch"],
                   help="how the model's ops run: cpu (native kernels, PyTorch fallback), "
                   "triton (our Triton kernels; on the CPU only with TRITON_INTERPRET=1), torch "
                   "(PyTorch ops); auto: cpu on the CPU, triton on CUDA (default: auto)")
    p.add_argument("--threads", type=at_least(1), default=None, help="CPU threads")
    p.add_argument("--max-model-len", type=at_least(1), default=0,
                   help="context length to serve (default: the model's)")
    p.add_argument("--kv-cache-memory", type=byte_size(GIB, "GiB"), default=0, metavar="SIZE",
                   help="KV cache size: 2 or 2G (GiB), 512M, 4GB (default: up to 1 GiB)")
    p.add_argument("--decode-steps", type=at_least(1), default=0,
                   help="decode steps one call may run back to back while every running "
                   "request decodes greedily or samples with a top-k of 1-64, and none waits for "
                   "KV room (the CPU's native kernels; their tokens then arrive together, and a "
                   "request arriving meanwhile waits for the call); 1: a call a step "
                   "(default: 4)")
    add_store_args(p)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="localllm", description="Local LLM runtime")
    parser.add_argument("--verbose", "-v", action="store_true", help="log engine details")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one prompt")
    _model_args(g)
    add_sampling_args(g, temperature=0.8)
    g.add_argument("--chat", action="store_true",
                   help="treat PROMPT as one user message put through the chat template")
    g.add_argument("prompt", metavar="PROMPT")

    t = sub.add_parser("tokenize", help="print the token ids of TEXT")
    t.add_argument("--model", "-m")
    t.add_argument("--special", action="store_true",
                   help="let special-token text become special tokens")
    t.add_argument("text", metavar="TEXT")

    c = sub.add_parser("chat", help="interactive chat in the terminal")
    _model_args(c)
    add_sampling_args(c, temperature=0.7)
    c.add_argument("--system", default=None, help="system prompt")
    c.add_argument("--resume", nargs="?", const="", default=None, metavar="NAME",
                   help="continue a saved conversation (without NAME: the most recent; "
                   "--system replaces its system prompt)")
    c.add_argument("--no-save", action="store_true",
                   help="do not save the conversation after every reply (/save NAME still "
                   "does)")
    add_endpoint_args(c)

    from localllm.apps import bench, cache, info, quantize, summarize
    from localllm.apps.serve import add_parser as add_serve_parser

    quantize.add_parser(sub)
    add_serve_parser(sub, _model_args)
    summarize.add_parser(sub, _model_args, add_sampling_args)
    cache.add_parser(sub)
    info.add_parser(sub)
    bench.add_parser(sub, _model_args)
    return parser


def load_llm(args: argparse.Namespace, threads: int | None = None) -> LLM:
    from localllm.config import SchedulerConfig
    from localllm.llm import LLM
    from localllm.loader import stderr_progress

    cache = cache_config(args, args.kv_cache_memory)
    default = SchedulerConfig()
    sched = SchedulerConfig(
        max_model_len=args.max_model_len,
        max_num_seqs=getattr(args, "max_num_seqs", None) or default.max_num_seqs,
        max_num_batched_tokens=(getattr(args, "max_num_batched_tokens", None)
                                or default.max_num_batched_tokens),
        decode_steps=getattr(args, "decode_steps", 0) or default.decode_steps)
    llm = LLM(args.model, dtype=args.dtype, cache=cache, scheduler=sched,
              num_threads=threads or args.threads, progress=stderr_progress("loading"),
              quantize=args.quantize, device=args.device,
              backend=args.backend)
    print(f"[{llm.path.name}: {llm.backend.name} backend on {llm.backend.device.type}, "
          f"{llm.engine.kv_summary()}]",
          file=sys.stderr)
    return llm


def cmd_generate(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    params = sampling_params(args)  # a bad value is refused before the model loads
    llm = load_llm(args)
    try:
        return _generate(args, params, llm, t0)
    finally:
        llm.close()  # the prefix cache's last blocks reach the disk


def _generate(args: argparse.Namespace, params: SamplingParams, llm: LLM, t0: float) -> int:
    ids = (llm.encode_chat([{"role": "user", "content": args.prompt}]) if args.chat
           else llm.encode(args.prompt))
    t1 = time.perf_counter()
    n = 0
    first = None
    reason = None
    for out in llm.stream(ids, params):
        if out.token_ids and first is None:
            first = time.perf_counter()
        n += len(out.token_ids)
        sys.stdout.write(out.text)
        sys.stdout.flush()
        reason = out.finish_reason
        if out.error:
            print(f"\nlocalllm: error: {out.error}", file=sys.stderr)
            return 1
    t2 = time.perf_counter()
    sys.stdout.write("\n")
    decode = (n - 1) / (t2 - first) if first and n > 1 and t2 > first else 0.0
    cached = llm.engine.bm.prefix_hits
    print(f"[load {t1 - t0:.2f} s | prompt {len(ids)} tokens ({cached} cached), first token "
          f"{(first or t2) - t1:.3f} s | {n} tokens, {decode:.1f} tokens/s | {reason}]",
          file=sys.stderr)
    return 0


def cmd_tokenize(args: argparse.Namespace) -> int:
    from localllm.gguf.reader import GGUFFile
    from localllm.model_path import find_model
    from localllm.text.tokenizer import Tokenizer

    path = find_model(args.model)
    if path.is_dir():  # a Hugging Face checkpoint folder
        tok = Tokenizer.from_tokenizer_json(path)
    else:
        tok = Tokenizer.from_gguf_metadata(GGUFFile(path).metadata, source=str(path))
    ids = tok.encode(args.text, add_special=True, parse_special=args.special)
    print(" ".join(map(str, ids)))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="localllm: %(message)s", stream=sys.stderr)
    try:
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "tokenize":
            return cmd_tokenize(args)
        if args.command == "quantize":
            from localllm.apps.quantize import cmd_quantize

            return cmd_quantize(args)
        if args.command == "serve":
            from localllm.apps.serve import cmd_serve

            return cmd_serve(args, load_llm)
        if args.command == "summarize":
            from localllm.apps.summarize import cmd_summarize

            return cmd_summarize(args, load_llm)
        if args.command == "cache":
            from localllm.apps.cache import cmd_cache

            return cmd_cache(args)
        if args.command == "info":
            from localllm.apps.info import cmd_info

            return cmd_info(args)
        if args.command == "bench":
            from localllm.apps.bench import cmd_bench

            return cmd_bench(args)
        if args.command == "chat":
            from localllm.apps.chat import run_chat

            return run_chat(args, load_llm, sampling_params(args))
    except LocalLLMError as e:
        print(f"localllm: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
