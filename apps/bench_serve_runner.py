"""Run `bench serve`'s requests on one event loop and record what the client sees.

Each request waits for its arrival time, then for a free `--concurrency` slot, then streams;
the time of every delta is kept. Beside them a sampler reads the engine's state every
`interval` seconds: the in-process engine's snapshot, or a remote server's `/metrics`
(`localllm serve`'s names, or vLLM's). Ctrl-C (a cancellation of the run) ends the open
streams and returns what was measured so far, marked interrupted.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import NamedTuple

from localllm.apps.bench_serve_workload import RequestSpec
from localllm.bench.timeline import EngineSample, RequestTimeline
from localllm.client import Client, ClientError, ContextOverflow, Delta
from localllm.config import SamplingParams

Probe = Callable[[], Awaitable["tuple[float, int, int, int] | None"]]

# /metrics sample name -> EngineSample field
_METRICS = {
    "localllm_kv_cache_utilization": "kv", "localllm_requests_running": "running",
    "localllm_requests_waiting": "waiting", "localllm_preemptions_total": "preemptions",
    "vllm:kv_cache_usage_perc": "kv", "vllm:gpu_cache_usage_perc": "kv",
    "vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting",
    "vllm:num_preemptions_total": "preemptions",
}


class RunResult(NamedTuple):
    records: list[RequestTimeline]  # in request order
    samples: list[EngineSample]
    interrupted: bool
    wall: float  # seconds the run took
    cpu_seconds: float  # CPU time of this process (all its threads) meanwhile


def parse_metrics(text: str) -> tuple[float, int, int, int] | None:
    """(KV utilization, running, waiting, preemptions) from Prometheus text, summed over
    labels; None when it has none of the known names."""
    from prometheus_client.parser import text_string_to_metric_families

    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = _METRICS.get(s.name)
            if key is not None:
                found[key] = found.get(key, 0.0) + s.value
    if not found:
        return None
    return (found.get("kv", 0.0), int(found.get("running", 0)), int(found.get("waiting", 0)),
            int(found.get("preemptions", 0)))


def engine_probe(client: Client) -> Probe | None:
    """How to read `client`'s engine state now, or None where nothing tells it."""
    from localllm.client.local import LocalClient
    from localllm.client.remote import RemoteClient

    if isinstance(client, LocalClient):
        engine = client.engine

        async def local() -> tuple[float, int, int, int]:
            s = engine.stats()
            return s.kv_utilization, s.num_running, s.num_waiting, s.preemptions
        return local
    if isinstance(client, RemoteClient):
        remote = client

        async def scrape() -> tuple[float, int, int, int] | None:
            text = await remote.get_text("/metrics")
            return parse_metrics(text) if text else None
        return scrape
    return None


class _Recorder:
    def __init__(self, n: int, progress: bool) -> None:
        from tqdm import tqdm

        self.records: list[RequestTimeline | None] = [None] * n
        self.tokens = 0
        self.bar = tqdm(total=n, unit="req", desc="bench serve", file=sys.stderr,
                        disable=not progress, dynamic_ncols=True)
        self.t0 = time.perf_counter()  # the run's time 0: every import is done

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def done(self, r: RequestTimeline) -> None:
        self.records[r.index] = r
        self.tokens += r.output_tokens
        self.bar.update(1)
        self.bar.set_postfix_str(f"{self.tokens / max(self.now(), 1e-9):.0f} tok/s out",
                                 refresh=False)


async def _one(client: Client, rec: _Recorder, i: int, spec: RequestSpec, arrival: float,
               params: SamplingParams, slots: asyncio.Semaphore | None) -> None:
    await asyncio.sleep(max(0.0, arrival - rec.now()))
    async with slots or contextlib.nullcontext():
        sent = rec.now()
        times: list[float] = []
        counts: list[int] = []
        last = Delta("")
        error: str | None = None
        finished: float | None = None
        p = dataclasses.replace(params, max_tokens=spec.output_len)
        stream = (client.stream_text(spec.prompt, p) if spec.prompt is not None
                  else client.stream_chat(spec.messages or [], p))
        try:
            async with contextlib.aclosing(stream) as deltas:
                async for d in deltas:
                    if d.tokens:
                        times.append(rec.now())
                        counts.append(d.tokens)
                    last = d
            finished = rec.now()
        except (ClientError, ContextOverflow) as e:
            error = str(e)
        except asyncio.CancelledError:
            error = "interrupted"
            raise
        finally:
            u = last.usage
            out = u.completion_tokens if u is not None and finished is not None else sum(counts)
            rec.done(RequestTimeline(i, arrival, sent, tuple(times), tuple(counts), finished, out,
                                     u.prompt_tokens if u else None,
                                     u.cached_tokens if u else None, last.finish_reason, error))


async def _sample(probe: Probe, rec: _Recorder, interval: float,
                  out: list[EngineSample]) -> None:
    while True:
        t = rec.now()
        got = await probe()
        if got is None and not out:
            return  # the server exports no engine state
        if got is not None:
            out.append(EngineSample(t, *got))
        await asyncio.sleep(max(0.0, interval - (rec.now() - t)))


async def run_workload(client: Client, specs: Sequence[RequestSpec], send_at: Sequence[float],
                       params: SamplingParams, concurrency: int | None,
                       interval: float = 0.05, progress: bool = True) -> RunResult:
    """Every request of `specs` sent at its `send_at` second (with at most `concurrency` open
    at once), with `params` but each spec's output length."""
    probe = engine_probe(client)
    rec = _Recorder(len(specs), progress)
    samples: list[EngineSample] = []
    sampler = (asyncio.create_task(_sample(probe, rec, interval, samples)) if probe else None)
    slots = asyncio.Semaphore(concurrency) if concurrency and not math.isinf(concurrency) \
        else None
    interrupted = False
    cpu0 = time.process_time()
    try:
        await asyncio.gather(*(_one(client, rec, i, s, send_at[i], params, slots)
                               for i, s in enumerate(specs)))
    except asyncio.CancelledError:
        interrupted = True
        task = asyncio.current_task()
        if task is not None:
            task.uncancel()
    finally:
        if sampler is not None:
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
        rec.bar.close()
    return RunResult([r for r in rec.records if r is not None], samples, interrupted,
                     rec.now(), time.process_time() - cpu0)
