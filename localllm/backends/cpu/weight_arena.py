"""The packed weights of a loaded model moved into one memory map on 2 MiB pages.

A decode step reads every packed weight once (about 95 MB for the default model). In 4 KiB
pages that is a TLB miss every 4 KiB of the stream: the second-level TLB of a Zen 4 core
covers 12 MB, so each step walks the page tables some 24,000 times, and the misses also hit
the attention's scattered K/V reads and the Python between steps. Linux gives a private
anonymous map 2 MiB pages (transparent huge pages) where `/sys/kernel/mm/transparent_hugepage/
enabled` says `always` or `madvise` and the map asks for them (`MADV_HUGEPAGE`), so
`gather` copies the weights into one such map, in the order the model declares them (a step's
order), 64-byte aligned, and swaps each weight's tensors for views of it (pack, then swap).
Measured on the default model (2-core EPYC VM, Zen 4): decode about 4% faster at one
sequence, 1% at eight; loading 0.3-0.6 s slower there, where the first touch of each fresh
2 MiB page is slow (the copy takes 0.6-1 s).

Where the kernel has no transparent huge pages for such a map (mode `never`, not Linux), or
with `LOCALLLM_HUGE_PAGES=0`, the weights stay where loading put them.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

import torch

from localllm.backends.cpu.weights import CpuPackedWeight

PAGE = 2 << 20  # bytes: a transparent huge page on x86-64
ALIGN = 64  # bytes: each tensor starts on a cache line
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


class Gathered(NamedTuple):
    tensors: int  # tensors moved
    nbytes: int  # their bytes (without alignment)
    huge: bool  # whether the map asked for 2 MiB pages (the kernel may still refuse some)


def huge_pages_setting() -> str | None:
    """The kernel's transparent huge page mode (`always`, `madvise` or `never`), or None where
    there is none (not Linux)."""
    try:
        text = THP_SETTING.read_text()
    except OSError:
        return None
    chosen = [w[1:-1] for w in text.split() if w.startswith("[")]
    return chosen[0] if chosen else None


def enabled() -> bool:
    """Whether loading moves packed weights into a huge-page map: where the kernel has
    transparent huge pages for a map that asks (`always` or `madvise`) and
    LOCALLLM_HUGE_PAGES is not 0."""
    return (os.environ.get("LOCALLLM_HUGE_PAGES", "1") != "0"
            and hasattr(mmap, "MAP_PRIVATE") and hasattr(mmap, "MADV_HUGEPAGE")
            and huge_pages_setting() in ("always", "madvise"))


def packed_weights(model: torch.nn.Module) -> list[CpuPackedWeight]:
    """Every distinct packed weight of `model`, in module order."""
    seen: set[int] = set()
    out: list[CpuPackedWeight] = []
    for module in model.modules():
        w = getattr(module, "qweight", None)
        if isinstance(w, CpuPackedWeight) and id(w) not in seen:
            seen.add(id(w))
            out.append(w)
    return out


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def huge_page_buffer(nbytes: int) -> tuple[torch.Tensor, bool]:
    """A new uint8 tensor of `nbytes` in a private anonymous map, starting on a 2 MiB boundary
    and asked for 2 MiB pages (before its first touch, so that faults take whole pages), and
    whether the kernel took the request. Only the pages touched become resident."""
    # one page of slack, so that the tensor can start on a boundary
    area = mmap.mmap(-1, nbytes + PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    huge = False
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            area.madvise(mmap.MADV_HUGEPAGE)
            huge = True
        except OSError:  # a kernel without transparent huge pages
            pass
    start = -torch.frombuffer(area, dtype=torch.uint8, count=1).data_ptr() % PAGE
    # the tensor holds `area` alive
    return torch.frombuffer(area, dtype=torch.uint8, count=nbytes, offset=start), huge


def gather(weights: Iterable[CpuPackedWeight]) -> Gathered:
    """Move each weight's packed codes and scales into one `huge_page_buffer` and point the
    weights at views of it. Each tensor is freed as soon as it is copied, so memory grows by
    at most one tensor."""
    ws = list(weights)
    total = sum(_aligned(t.numel() * t.element_size()) for w in ws
                for t in (w.packed, w.scales_zeros))
    if total == 0:
        return Gathered(0, 0, False)
    flat, huge = huge_page_buffer(total)
    at = 0
    moved = 0
    for w in ws:
        for name in ("packed", "scales_zeros"):
            t: torch.Tensor = getattr(w, name)
            n = t.numel() * t.element_size()
            view = flat[at:at + n].view(t.dtype).view(t.shape)
            view.copy_(t)
            setattr(w, name, view)
            del t
            at += _aligned(n)
            moved += n
    return Gathered(2 * len(ws), moved, huge)
