"""`localllm summarize PATH...`: a summary of each file, folder (recursive) or stdin (`-`).

Every input runs through one client (the in-process engine, or `--endpoint`) at once, up to
`--concurrency` requests, so continuous batching serves them together. Summaries go to stdout
(each under a `## path` header, in input order) or, with `--out DIR`, to files beside a
manifest that lets a rerun skip inputs whose bytes and settings have not changed. Exit status:
0 when every readable input was summarized, 1 when some failed, 2 for bad usage; Ctrl-C keeps
what finished (130). The run itself is in summarize_run.py.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from pathlib import Path
from typing import Any

from localllm.apps.connect import LoadFn, add_endpoint_args


def add_parser(sub: Any, model_args: Any, sampling_args: Any) -> None:
    s = sub.add_parser("summarize", help="summarize files, folders and stdin",
                       description="Summarize files, folders (recursive) and stdin (-).")
    model_args(s)
    sampling_args(s, temperature=0.0, max_tokens="twice --max-words plus 16")
    s.set_defaults(max_tokens=None)  # from --max-words
    add_endpoint_args(s)
    s.add_argument("paths", nargs="+", metavar="PATH", help="a file, a folder, or - for stdin")
    s.add_argument("--out", "-o", type=Path, default=None, metavar="DIR",
                   help="write DIR/<path>.md per input and DIR/manifest.json (--format json: "
                   "DIR/summaries.json); a rerun skips unchanged inputs (default: stdout)")
    s.add_argument("--format", choices=["md", "json"], default="md",
                   help="md: Markdown per input; json: one JSON document (default: md)")
    s.add_argument("--max-words", type=int, default=100,
                   help="longest summary asked for, in words (default 100); --max-tokens "
                   "defaults to twice this plus 16")
    s.add_argument("--prompt", default=None, metavar="TEXT",
                   help="the instruction (system prompt) instead of the default one")
    s.add_argument("--include", action="append", default=[], metavar="GLOB",
                   help="in folders, only files matching GLOB (gitignore syntax; repeatable)")
    s.add_argument("--exclude", action="append", default=[], metavar="GLOB",
                   help="in folders, leave out paths matching GLOB (repeatable)")
    s.add_argument("--no-gitignore", action="store_true",
                   help="in folders, also read the files .gitignore files exclude")
    s.add_argument("--hidden", action="store_true",
                   help="in folders, also read hidden files and folders (.name)")
    s.add_argument("--follow-symlinks", action="store_true",
                   help="follow symlinks that lead out of a folder")
    s.add_argument("--concurrency", type=int, default=8, metavar="N",
                   help="requests in flight at once (default 8)")


def cmd_summarize(args: argparse.Namespace, load: LoadFn) -> int:
    from localllm.apps.summarize_run import Run, check

    check(args)
    run = Run(args)
    try:
        return asyncio.run(run.main(load))
    except KeyboardInterrupt:
        with contextlib.suppress(Exception):
            if run.progress is not None:
                run.progress.close()
        run.interrupted()
        return 130
