"""The Triton backend on the attention variants (under TRITON_INTERPRET=1 where there is no
GPU): its decode and extend kernels get each layer's soft-cap and sliding window, so fp32
logits and greedy tokens of tiny Gemma 2 (soft-caps, local/global layers) and Mistral (window
everywhere, blocks released behind it) models equal the CPU backend's, across chunked prompts
and decode steps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from variant_models import VOCAB, build_hf

from localllm import LLM, CacheConfig, SamplingParams, SchedulerConfig
from localllm.engine.model_runner import prompt_logits

pytest.importorskip("triton")
pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("case", ["gemma2", "mistral-window"])
def test_triton_matches_the_cpu_backend(case: str, tmp_path: Path) -> None:
    build_hf(tmp_path, case)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, VOCAB, (30,), generator=g).tolist()
    logits, tokens = {}, {}
    for backend in ("cpu", "triton"):
        llm = LLM(tmp_path, dtype="float32", backend=backend,
                  cache=CacheConfig(block_size=4),
                  scheduler=SchedulerConfig(max_num_batched_tokens=8))
        model = llm.loaded.model
        # a prompt in chunks of 8 positions, then one position a step
        logits[backend] = torch.cat([prompt_logits(model, ids[:24], block_size=4, chunk=8),
                                     prompt_logits(model, ids, block_size=4, chunk=1)[24:]])
        outs = llm.generate([ids[:20], ids[:13]], SamplingParams(max_tokens=10, temperature=0,
                                                                 ignore_eos=True))
        tokens[backend] = [o.token_ids for o in outs]
    diff = (logits["triton"] - logits["cpu"]).abs().max().item()
    assert diff < 1e-4 * max(1.0, logits["cpu"].abs().max().item()), diff
    assert tokens["triton"] == tokens["cpu"]
