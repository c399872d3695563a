"""`bench serve --plot FILE.png`: where a run's time went, in six panels (matplotlib).

Top: the distributions (CDFs) of TTFT, ITL and E2E latency, with the SLOs where set. Bottom,
over the run's time: each request as a bar (waiting for a client slot, waiting for its first
token, streaming), the engine's KV utilization with running and waiting requests, and the
output tokens/s with the spans in which prompts were processed (from a request's sending to
its first token) shaded. The diagnosis is the figure's title.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from localllm.apps.bench_serve_runner import RunResult
from localllm.bench.diagnosis import Finding
from localllm.bench.summary import Slo
from localllm.errors import LocalLLMError

TITLES = ("TTFT CDF", "ITL CDF", "E2E latency CDF", "Requests over time",
          "Engine: KV cache and queue", "Output tokens/s")


def _cdf(ax: Any, values_s: Sequence[float], title: str, slo_s: float | None) -> None:
    ax.set_title(title)
    ax.set_xlabel("ms")
    ax.set_ylabel("share of values")
    if values_s:
        xs = np.sort(np.asarray(values_s) * 1000)
        ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post")
        for q in (50, 99):
            ax.axvline(float(np.percentile(xs, q)), color="grey", lw=0.8, ls=":")
    if slo_s is not None:
        ax.axvline(slo_s * 1000, color="red", lw=1, label="SLO")
        ax.legend(loc="lower right")
    ax.grid(alpha=0.3)


def figure(run: RunResult, findings: list[Finding], slo: Slo) -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise LocalLLMError("--plot needs matplotlib: pip install 'localllm[plot]'") from None
    done = [r for r in run.records if r.ok]
    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5), layout="constrained")
    (a_ttft, a_itl, a_e2e), (a_req, a_eng, a_tok) = axes
    _cdf(a_ttft, [r.ttft for r in done if r.ttft is not None], TITLES[0], slo.ttft)
    _cdf(a_itl, [g for r in done for g in r.itls], TITLES[1], slo.itl)
    _cdf(a_e2e, [r.e2e for r in done if r.e2e is not None], TITLES[2], slo.e2e)

    a_req.set_title(TITLES[3])
    for r in run.records:
        end = r.finished if r.finished is not None else max(r.chunk_times, default=r.sent)
        first = r.chunk_times[0] if r.chunk_times else end
        for start, stop, color in ((r.arrival, r.sent, "tab:grey"), (r.sent, first, "tab:red"),
                                   (first, end, "tab:green")):
            if stop > start:
                a_req.barh(r.index, stop - start, left=start, height=0.8, color=color, lw=0)
    a_req.set_xlabel("s")
    a_req.set_ylabel("request")
    a_req.invert_yaxis()
    from matplotlib.patches import Patch

    a_req.legend(handles=[Patch(color="tab:grey", label="client slot wait"),
                          Patch(color="tab:red", label="to first token"),
                          Patch(color="tab:green", label="streaming")], loc="upper right",
                 fontsize="small")

    a_eng.set_title(TITLES[4])
    a_eng.set_xlabel("s")
    if run.samples:
        t = [s.t for s in run.samples]
        a_eng.fill_between(t, [100 * s.kv_utilization for s in run.samples], step="post",
                           alpha=0.3, color="tab:purple", label="KV used %")
        a_eng.set_ylabel("KV cache used (%)")
        counts = a_eng.twinx()
        counts.step(t, [s.running for s in run.samples], where="post", color="tab:green",
                    label="running")
        counts.step(t, [s.waiting for s in run.samples], where="post", color="tab:red",
                    label="waiting")
        counts.set_ylabel("requests")
        peak = max(max(s.running, s.waiting) for s in run.samples)
        counts.set_ylim(0, 1.4 * max(peak, 1))  # room for the legend above the lines
        a_eng.set_ylim(0, 140)
        a_eng.set_yticks(range(0, 101, 20))
        h1, l1 = a_eng.get_legend_handles_labels()
        h2, l2 = counts.get_legend_handles_labels()
        a_eng.legend(h1 + h2, l1 + l2, loc="upper right", fontsize="small")
    else:
        a_eng.text(0.5, 0.5, "no engine state\n(the server exports none at /metrics)",
                   ha="center", va="center", transform=a_eng.transAxes)

    a_tok.set_title(TITLES[5])
    a_tok.set_xlabel("s")
    stamps = [(t, n) for r in run.records for t, n in zip(r.chunk_times, r.chunk_tokens)]
    if stamps:
        end = max(t for t, _ in stamps)
        width = max(end / 60, 0.05)
        edges = np.arange(0, end + width, width)
        hist, _ = np.histogram([t for t, _ in stamps], bins=edges,
                               weights=[n for _, n in stamps])
        a_tok.step(edges[:-1], hist / width, where="post", color="tab:blue")
        for r in run.records:
            if r.chunk_times:
                a_tok.axvspan(r.sent, r.chunk_times[0], color="tab:red", alpha=0.12, lw=0)
        a_tok.set_ylabel("tokens/s (red: prompts being processed)")
    for ax in (a_req, a_eng, a_tok):
        ax.grid(alpha=0.3)
    fig.suptitle("\n".join(textwrap.fill(f.line(), 170) for f in findings), fontsize="medium")
    return fig


def save(fig: Any, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=100)
    plt.close(fig)
