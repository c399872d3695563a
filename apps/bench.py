"""`localllm bench`: on-device benchmarks, one subcommand each.

`SUBCOMMANDS` maps a name to its module; each module has `add_parser(sub, model_args)` (adding
its parser to the `bench` group) and `run(args) -> int`. A new benchmark is a module and a line
here.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable

ModelArgs = Callable[[argparse.ArgumentParser], None]

SUBCOMMANDS = {
    "latency": "localllm.apps.bench_latency",
    "serve": "localllm.apps.bench_serve",
}


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser],
               model_args: ModelArgs) -> None:
    b = sub.add_parser("bench", help="on-device benchmarks: " + ", ".join(SUBCOMMANDS))
    bs = b.add_subparsers(dest="bench_command", required=True)
    for module in SUBCOMMANDS.values():
        importlib.import_module(module).add_parser(bs, model_args)


def cmd_bench(args: argparse.Namespace) -> int:
    result: int = importlib.import_module(SUBCOMMANDS[args.bench_command]).run(args)
    return result
