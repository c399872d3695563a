"""`bench serve`'s report: the text table, and the JSON record of the whole run."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from localllm.apps.bench_serve_runner import RunResult
from localllm.bench.diagnosis import Finding, Signals
from localllm.bench.summary import EngineSummary, ServeSummary, Slo, Stat
from localllm.client import Client
from localllm.model_card import ModelCard


def machine(client: Client) -> dict[str, Any]:
    """The machine of this run (`localllm.machine.describe`) and where the model ran."""
    import torch

    from localllm.client.local import LocalClient
    from localllm.machine import describe

    if isinstance(client, LocalClient):
        m = describe(client.llm.backend.name, client.llm.backend.device)
    else:  # the model runs in the server; this machine only sends requests
        m = describe("none here", torch.device("cpu"))
    return m | {"runs_on": client.card.runs_on}


def _ms(s: Stat | None) -> str:
    if s is None:
        return f"{'-':>9}" * 4
    return "".join(f"{1000 * v:9.1f}" for v in s)


def itl_note(s: ServeSummary) -> str | None:
    """A line under the table when tokens came in bursts: half the gaps under a quarter of
    the time per token (several decode steps to a call, or a client reading queued deltas)."""
    if s.itl is None or s.tpot is None or s.itl.p50 >= 0.25 * s.tpot.mean:
        return None
    return (f"ITL: tokens arrived in bursts (the median gap {1000 * s.itl.p50:.1f} ms is inside "
            f"one); TPOT ({1000 * s.tpot.mean:.1f} ms mean) is the time per token, ITL p90/p99 "
            "the pauses between bursts")


def text(card: ModelCard, run: RunResult, s: ServeSummary, e: EngineSummary | None,
         slo: Slo, findings: list[Finding], load: str) -> str:
    lines = [f"bench serve · {card.banner()}",
             f"{load} · {s.completed} completed, {s.failed} failed in {s.duration:.2f} s"
             + (" (interrupted: what was measured so far)" if run.interrupted else ""),
             f"tokens: {s.input_tokens:,} in, {s.output_tokens:,} out · "
             f"{s.request_throughput:.2f} requests/s · output {s.output_throughput:.1f} tokens/s"
             + (f" (per request: mean {s.per_request_throughput.mean:.1f}, p50 "
                f"{s.per_request_throughput.p50:.1f})" if s.per_request_throughput else "")]
    if s.good is not None and s.goodput is not None:
        limits = ", ".join(f"{name} <= {1000 * v:g} ms" for name, v in (
            ("TTFT", slo.ttft), ("ITL", slo.itl), ("TPOT", slo.tpot), ("E2E", slo.e2e))
            if v is not None)
        lines.append(f"goodput: {s.goodput:.2f} requests/s ({s.good} of {s.completed} met "
                     f"{limits})")
    if s.prefix_hit_rate is not None:
        lines.append(f"prefix cache: {100 * s.prefix_hit_rate:.0f}% of prompt tokens reused")
    lines += ["", f"{'(ms)':8}{'mean':>9}{'p50':>9}{'p90':>9}{'p99':>9}",
              f"{'TTFT':8}{_ms(s.ttft)}", f"{'ITL':8}{_ms(s.itl)}",
              f"{'TPOT':8}{_ms(s.tpot)}", f"{'E2E':8}{_ms(s.e2e)}"]
    lines += [note for note in (itl_note(s),) if note] + [""]
    if e is None:
        lines.append("engine: the server exports no engine state at /metrics")
    else:
        lines.append(f"engine ({e.samples} samples): KV cache mean {100 * e.kv_mean:.0f}%, "
                     f"peak {100 * e.kv_peak:.0f}% · running mean {e.running_mean:.1f}, peak "
                     f"{e.running_peak} · waiting mean {e.waiting_mean:.1f}, peak "
                     f"{e.waiting_peak} · {e.preemptions} preemptions")
    lines += [f"diagnosis: {f.line()}" for f in findings]
    return "\n".join(lines)


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    out = {}
    for k, v in vars(args).items():
        if callable(v):
            continue
        try:
            json.dumps(v, allow_nan=False)
            out[k] = v
        except (TypeError, ValueError):
            out[k] = str(v)
    return out


def write_json(path: Path, args: argparse.Namespace, client: Client, run: RunResult,
               s: ServeSummary, e: EngineSummary | None, sig: Signals,
               findings: list[Finding]) -> None:
    summary = {k: v._asdict() if isinstance(v, Stat) else v for k, v in s._asdict().items()}
    doc = {
        "settings": _settings(args), "machine": machine(client),
        "model": {"name": client.card.name, "quantization": client.card.quantization,
                  "context": client.card.context, "runs_on": client.card.runs_on},
        "interrupted": run.interrupted, "summary": summary,
        "engine": e._asdict() if e else None, "signals": sig._asdict(),
        "diagnosis": [f._asdict() for f in findings],
        "requests": [{"index": r.index, "arrival_s": r.arrival, "sent_s": r.sent,
                      "chunk_times_s": list(r.chunk_times), "chunk_tokens": list(r.chunk_tokens),
                      "finished_s": r.finished, "prompt_tokens": r.prompt_tokens,
                      "cached_tokens": r.cached_tokens, "output_tokens": r.output_tokens,
                      "finish_reason": r.finish_reason, "error": r.error,
                      "ttft_s": r.ttft, "tpot_s": r.tpot, "e2e_s": r.e2e}
                     for r in run.records],
        "samples": [x._asdict() for x in run.samples],
    }
    path.write_text(json.dumps(doc, indent=1) + "\n")
