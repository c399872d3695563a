"""`localllm quantize SRC -o OUT.gguf --type q4_0|q4_1|q8_0`: requantize a GGUF file."""

from __future__ import annotations

import argparse
import sys

QUANT_TYPES = ("q4_0", "q4_1", "q8_0")


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    q = sub.add_parser("quantize", help="write a GGUF file requantized to Q4_0, Q4_1 or Q8_0")
    q.add_argument("src", metavar="SRC", help="source GGUF file (any type localllm loads)")
    q.add_argument("--output", "-o", required=True, metavar="OUT", help="output GGUF file")
    # checked by the command, so a bad name is a one-line error like the others
    q.add_argument("--type", "-t", default="q8_0", help=f"{'|'.join(QUANT_TYPES)} "
                   "(default: q8_0)")


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def cmd_quantize(args: argparse.Namespace) -> int:
    from localllm.quant.gguf_writer import parse_target, quantize_gguf

    parse_target(args.type)  # fail before reading the source
    tty = sys.stderr.isatty()

    def progress(done: int, total: int, name: str, qtype: str) -> None:
        line = f"[{done}/{total}] {name} -> {qtype}"
        if tty:
            end = "\n" if done == total else ""
            print(f"\r\x1b[K{line}", end=end, file=sys.stderr, flush=True)
        else:
            print(line, file=sys.stderr)

    res = quantize_gguf(args.src, args.output, args.type, progress)
    if res.kept_f32:
        print(f"kept F32 (row length not a multiple of 32): {', '.join(res.kept_f32)}",
              file=sys.stderr)
    print(f"{args.src} ({_mib(res.in_bytes)}) -> {res.out} ({_mib(res.out_bytes)}, "
          f"{args.type.lower()}) in {res.seconds:.1f} s", file=sys.stderr)
    return 0
