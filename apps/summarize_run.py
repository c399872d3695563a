"""One `localllm summarize` run: read the inputs, skip the unchanged, summarize the rest at
once through one client, write or print each as it finishes."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import shlex
import sys
import time
from typing import Any, NamedTuple

from localllm.apps.connect import LoadFn, open_client
from localllm.apps.sampling_args import sampling_params
from localllm.apps.summarize_files import Source, Unreadable, decode, discover, read_source
from localllm.apps.summarize_out import OutDir, entry, settings_hash, sha256
from localllm.apps.summarize_progress import Progress
from localllm.apps.summarize_split import Summarizer, default_instruction
from localllm.client.base import Client
from localllm.config import SamplingParams
from localllm.errors import LocalLLMError


class Job(NamedTuple):
    order: int
    source: Source
    text: str
    content: str  # SHA-256 of the bytes


def _params(args: argparse.Namespace) -> SamplingParams:
    return sampling_params(args, args.max_tokens or 2 * args.max_words + 16)


def check(args: argparse.Namespace) -> None:
    if args.max_words < 1:
        raise LocalLLMError(f"--max-words must be at least 1, got {args.max_words}")
    if args.concurrency < 1:
        raise LocalLLMError(f"--concurrency must be at least 1, got {args.concurrency}")
    if args.prompt is not None and not args.prompt.strip():
        raise LocalLLMError("--prompt is empty: give an instruction, or leave it out")


class Run:
    """One summarize command; its counts outlive an interrupted event loop."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.params = _params(args)
        self.instruction = args.prompt or default_instruction(args.max_words)
        self.out = OutDir(args.out, args.format) if args.out else None
        self.total = self.done = self.failed = self.skipped = self.unchanged = 0
        self.output_tokens = 0
        self.records: dict[int, dict[str, Any]] = {}
        self.settled: set[int] = set()  # indices of jobs done or failed
        self._printed = 0  # stdout: summaries are printed in input order
        self.progress: Progress | None = None

    async def main(self, load: LoadFn) -> int:
        args = self.args
        found = discover(args.paths, args.include, args.exclude, args.follow_symlinks,
                         not args.no_gitignore, args.hidden, [args.out] if args.out else [])
        for s in found.skipped:
            self._skip(s.name, s.reason)
        jobs: list[Job] = []
        for source in found.sources:
            try:
                data = read_source(source)
                jobs.append(Job(len(jobs), source, decode(data), sha256(data)))
            except Unreadable as e:
                self._skip(source.name, str(e))
        if found.ignored:
            print(f"[left out {found.ignored} hidden or ignored paths (.gitignore, --include, "
                  f"--exclude)]", file=sys.stderr)
        if not jobs:
            print("[nothing to summarize]", file=sys.stderr)
            return 0
        client = await open_client(args, load)
        try:
            return await self._summarize(client, jobs)
        finally:
            await client.aclose()

    def _skip(self, name: str, reason: str) -> None:
        self.skipped += 1
        line = f"localllm: skipped {name}: {reason}"
        if self.progress is not None:
            self.progress.say(line)
        else:
            print(line, file=sys.stderr)

    async def _summarize(self, client: Client, jobs: list[Job]) -> int:
        print(f"[{client.card.banner()}]", file=sys.stderr)
        settings = settings_hash({"instruction": self.instruction,
                                  "params": dataclasses.asdict(self.params),
                                  "model": dataclasses.asdict(client.card)})
        if self.out is not None:
            todo = [j for j in jobs if not self.out.unchanged(j.source, j.content, settings)]
            self.unchanged = len(jobs) - len(todo)
            jobs = todo
        if self.unchanged:
            print(f"[{self.unchanged} unchanged since the last run, skipped]", file=sys.stderr)
        self.total = len(jobs)
        summarizer = Summarizer(client, self.instruction, self.params, self.args.concurrency)
        if jobs:  # a context too small for any summary is bad usage, not a failed file
            await summarizer.budget(max((j.source.name for j in jobs), key=len))
        t0 = time.perf_counter()
        self.progress = Progress(len(jobs))
        queue: asyncio.Queue[Job] = asyncio.Queue()
        for j in jobs:
            queue.put_nowait(j)
        ticker = asyncio.create_task(self._tick(summarizer))
        try:
            await asyncio.gather(*(self._worker(queue, summarizer, settings)
                                   for _ in range(min(self.args.concurrency, len(jobs)))))
        finally:
            ticker.cancel()
            self.progress.close()
        if self.out is None and self.args.format == "json":
            files = [self.records[i] for i in sorted(self.records)]
            print(json.dumps({"files": files}, indent=1, ensure_ascii=False))
        seconds = time.perf_counter() - t0
        rate = self.output_tokens / seconds if seconds > 0 else 0.0
        print(f"[summarized {self.done} of {self.total} files in {seconds:.1f} s, "
              f"{self.output_tokens} output tokens ({rate:.1f} tokens/s); {self.skipped} "
              f"skipped, {self.unchanged} unchanged, {self.failed} failed"
              + (f"; in {self.args.out}]" if self.out else "]"), file=sys.stderr)
        return 1 if self.failed else 0

    async def _tick(self, summarizer: Summarizer) -> None:
        while self.progress is not None:
            self.progress.tick(summarizer.output_tokens)
            await asyncio.sleep(0.5)

    async def _worker(self, queue: asyncio.Queue[Job], summarizer: Summarizer,
                      settings: str) -> None:
        assert self.progress is not None
        while not queue.empty():
            job = queue.get_nowait()
            name = job.source.name
            t0 = time.perf_counter()
            try:
                summary = await summarizer.summarize(name, job.text)
            except LocalLLMError as e:
                self.failed += 1
                self.progress.failed(name, str(e))
                self.settled.add(job.order)
                self._print_ready()
                continue
            record = entry(job.source, job.content, settings, summary,
                           time.perf_counter() - t0)
            self.output_tokens += summary.output_tokens
            self.done += 1
            self.settled.add(job.order)
            if self.out is not None:
                self.out.save(job.source, record, summary.text)
            else:
                self.records[job.order] = {**record, "summary": summary.text}
                self._print_ready()
            parts = (f"{summary.parts} parts combined in {summary.rounds} rounds, "
                     if summary.parts > 1 else "")
            self.progress.finished(name, f"{parts}{summary.output_tokens} tokens, "
                                   f"{record['seconds']:.1f} s", summarizer.output_tokens)

    def _print_ready(self) -> None:
        """stdout, md: print the summaries whose predecessors have all settled."""
        if self.out is not None or self.args.format != "md":
            return
        while self._printed in self.settled:
            r = self.records.get(self._printed)
            if r is not None:
                sys.stdout.write(f"## {r['input']}\n\n{r['summary']}\n\n")
                sys.stdout.flush()
            self._printed += 1

    def interrupted(self) -> None:
        command = shlex.join(["localllm", *sys.argv[1:]])
        if self.out is not None:
            kept = f"; finished summaries are kept in {self.args.out}"
            how = f"run the same command again to continue (finished files are skipped):\n" \
                  f"  {command}"
        else:
            kept = " (printed above)"
            how = "add --out DIR to keep summaries across runs and continue where one stopped"
        print(f"\nlocalllm: interrupted after {self.done} of {self.total} files{kept}; {how}",
              file=sys.stderr)
