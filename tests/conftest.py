"""Shared fixtures: paths of the real test models (skipping with a reason when absent).

Without a CUDA GPU, Triton kernels run under its interpreter on CPU tensors: TRITON_INTERPRET
must be set before any kernel module is imported (triton.jit reads it then), so it is set here,
before the test modules are collected.

The on-disk prefix cache is off in tests (LOCALLLM_PREFIX_CACHE=0, inherited by the processes
they start) unless a test turns it on with its own directory: tests must neither write to the
user's cache directory nor get prefixes stored by other tests.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ["LOCALLLM_PREFIX_CACHE"] = "0"

ROOT = Path(__file__).resolve().parents[1]
# `python -m pytest` puts the checkout's root on sys.path, where kernels/, models/ and apps/
# (installed as localllm.kernels, ...) would shadow top-level packages of the same names:
# transformers imports the `kernels` package it depends on and found ours instead.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT]

from localllm.model_path import INSTALL_HINT, default_model_path  # noqa: E402

SHARED_MODELS = ROOT.parent / "shared" / "models"
STORIES = SHARED_MODELS / "stories260K.gguf"


@pytest.fixture(scope="session")
def stories_path() -> Path:
    if not STORIES.is_file():
        pytest.skip(f"test model {STORIES} is absent (it lives in ../shared/models)")
    return STORIES


@pytest.fixture(scope="session")
def smollm_path() -> Path:
    p = default_model_path()
    if p is None:
        pytest.skip(f"default model not installed: {INSTALL_HINT}")
    return p


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Run a module's models on one torch thread: they are small, and on a shared 2-core
    machine a second OpenMP thread that waits for a busy core makes steps many times slower."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(params=["native", "native-dense", "native-avx2", "pytorch"])
def cpu_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Runs a test through the native CPU kernels (AMX tiles where the CPU has them), through
    them as on CPUs without AMX (the AVX-512 kernels: prompts through the dequantized weight,
    decoding rows off the tiles), through the AVX2 build of the kernels on a CPU whose
    default is the AVX-512 one ("native-avx2-vnni", where a test asks for it: the AVX2 build
    with AVX-VNNI), and through PyTorch ops alone (machines without AVX2 or a
    compiler)."""
    from localllm.kernels import cpu_native

    amx = ""  # the AMX mode to restore
    build = {"native-avx2": "avx2", "native-avx2-vnni": "avx2_vnni"}.get(request.param)
    if build:
        if cpu_native.isa() == build or build not in cpu_native.isas_available():
            pytest.skip(f"the {build} build is this machine's default (\"native\") or does not run")
        monkeypatch.setattr(cpu_native, "_active", build)
    elif request.param.startswith("native"):
        if not cpu_native.available():
            pytest.skip("native CPU kernels are not available here (AVX2 + compiler)")
        monkeypatch.setattr(cpu_native, "_gemm_on", request.param == "native")
        if request.param == "native-dense" and cpu_native.amx_enabled():
            amx = cpu_native.amx_mode()
            cpu_native.set_amx(False)
    else:
        monkeypatch.setattr(cpu_native, "_library", lambda: None)
    yield str(request.param)
    if amx:
        cpu_native.set_amx(amx)
