"""llama.cpp (llama-cpp-python) as a reference: a loader that avoids a crash on this hardware.

llama.cpp's extra CPU buffer types (runtime weight repacking, AMX) segfault while decoding the
default Q4_1 model on this project's AVX-512/AMX machines (llama-cpp-python 0.3.36), so they are
turned off; llama.cpp then runs its plain CPU kernels.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def open_llama(path: Path | str, n_ctx: int = 512, n_threads: int = 2,
               logits_all: bool = False, vocab_only: bool = False, n_batch: int = 512) -> Any:
    import llama_cpp
    import llama_cpp.llama as llama_mod

    original = llama_cpp.llama_model_default_params

    def without_extra_bufts() -> Any:
        params = original()
        params.use_extra_bufts = False
        return params

    llama_mod.llama_cpp.llama_model_default_params = without_extra_bufts
    try:
        return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_threads=n_threads,
                               n_threads_batch=n_threads, n_batch=n_batch,
                               logits_all=logits_all, vocab_only=vocab_only, verbose=False)
    finally:
        llama_mod.llama_cpp.llama_model_default_params = original


# llama.cpp and torch each bring their own OpenMP runtime; in one process their worker threads
# spin against each other after every parallel region and both slow down many times over. Work
# that runs llama.cpp's compute therefore runs in a child process.

def _logits(path: str, ids: list[int]) -> Any:
    import numpy as np

    # one thread: a reference need not be fast, and a second thread stalls on a busy machine
    llm = open_llama(path, n_ctx=max(512, len(ids)), n_threads=1, logits_all=True)
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)])


def _greedy(path: str, ids: list[int], n: int) -> list[int]:
    import numpy as np

    llm = open_llama(path, n_ctx=max(512, len(ids) + n), n_threads=1, logits_all=True)
    llm.eval(ids)
    out: list[int] = []
    for _ in range(n):
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        out.append(tok)
        llm.eval([tok])
    return out


def in_child(fn: Any, *args: Any) -> Any:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as ex:
        return ex.submit(fn, *args).result()


def llama_logits(path: Path | str, ids: list[int]) -> Any:
    """llama.cpp's logits of every position, [len(ids), vocab] float32 (child process)."""
    return in_child(_logits, str(path), list(ids))


def llama_greedy(path: Path | str, ids: list[int], n: int) -> list[int]:
    """n greedy token ids after the prompt `ids`, by llama.cpp (child process)."""
    return in_child(_greedy, str(path), list(ids), n)
