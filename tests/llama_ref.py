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
