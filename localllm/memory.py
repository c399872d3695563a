"""Handing freed memory back to the OS (glibc only; elsewhere these do nothing).

glibc keeps freed heap memory for reuse up to its trim threshold (set high after loading, so
that prefill does not unmap and refault its workspace every op: `loader.load_time_allocation`).
After a prompt, that workspace -- about 13 MB for 512 tokens of the default model -- would stay
resident through all the decode steps that follow; the engine returns it once prompts are done.
"""

from __future__ import annotations

import ctypes
from functools import cache


@cache
def glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt, libc.malloc_trim  # noqa: B018 (both exist: glibc)
        return libc
    except (OSError, AttributeError):  # not glibc
        return None


def release_free_memory() -> None:
    """Return the heap's free memory to the OS (`malloc_trim`: about 1 ms)."""
    libc = glibc()
    if libc is not None:
        libc.malloc_trim(0)
