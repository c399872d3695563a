"""Sliding-window models through the engine (fp32): batched, chunked-prefill and prefix-cached
runs equal each prompt's cold single run, with blocks of 4 positions and a window of 8; on a
model whose every layer slides (Mistral) blocks behind the window are released while the
request runs, and a later prompt sharing the prefix still gets exactly the cold tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from variant_models import VOCAB, WINDOW, build_hf

from localllm import LLM, CacheConfig, SamplingParams, SchedulerConfig
from localllm.engine.request import Request

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

BLOCK = 4
PARAMS = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", params=["mistral-window", "gemma2"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp(request.param)
    build_hf(folder, request.param)
    return folder


def _llm(folder: Path, budget: int = 512, num_blocks: int = 0) -> LLM:
    return LLM(folder, dtype="float32", cache=CacheConfig(block_size=BLOCK, num_blocks=num_blocks),
               scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget))


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(3, VOCAB, (22,), generator=g).tolist()
    tails = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (9, 3, 17, 1)]
    alone = torch.randint(3, VOCAB, (30,), generator=g).tolist()
    return [shared + t for t in tails] + [alone]


@pytest.fixture(scope="module")
def cold(model: Path) -> list[list[int]]:
    """Each prompt alone, on a fresh engine (nothing cached)."""
    return [_llm(model).generate([p], PARAMS)[0].token_ids for p in _prompts()]


def _run(llm: LLM, prompts: list[list[int]], arrivals: list[int]) -> list[Request]:
    eng = llm.engine
    reqs: list[Request | None] = [None] * len(prompts)
    step, released = 0, 0
    while step <= max(arrivals) or eng.has_unfinished():
        for i, p in enumerate(prompts):
            if arrivals[i] == step:
                reqs[i] = eng.add_request(p, PARAMS)
        eng.step()
        eng.bm.check_invariants(eng.scheduler.running)
        released = max([released] + [r.num_released_blocks for r in eng.scheduler.running])
        step += 1
    window_everywhere = llm.config.kv_window() > 0
    assert (released > 0) == window_everywhere, released
    return [r for r in reqs if r is not None]


def test_batched_and_chunked_match_cold(model: Path, cold: list[list[int]]) -> None:
    prompts = _prompts()
    assert len(prompts[0]) > 3 * WINDOW
    # 20 blocks hold fewer than 2 of the 5 sequences whole: released blocks are reused at once
    # (or, keeping every block, requests are preempted and recomputed)
    for budget, arrivals, blocks in ((512, [0] * len(prompts), 0), (7, [0, 2, 2, 5, 9], 0),
                                     (512, [0] * len(prompts), 20), (7, [0, 2, 2, 5, 9], 20)):
        llm = _llm(model, budget, blocks)
        reqs = _run(llm, prompts, arrivals)
        assert max(llm.engine.stats.tokens_per_step) <= budget
        assert [r.output_ids for r in reqs] == cold, (budget, blocks)


def test_prefix_cached_matches_cold(model: Path, cold: list[list[int]]) -> None:
    llm = _llm(model)
    prompts = _prompts()
    first = _run(llm, prompts[:1], [0])[0]
    assert first.num_cached_tokens == 0 and first.output_ids == cold[0]
    # the shared prefix (22 tokens: 5 full blocks) comes back from the cache for the others
    later = _run(llm, prompts[1:4], [0, 0, 0])
    assert all(r.num_cached_tokens >= 20 for r in later), [r.num_cached_tokens for r in later]
    assert [r.output_ids for r in later] == cold[1:4]
    # the same prompt again: everything but its last block cached, same tokens
    again = _run(llm, prompts[:1], [0])[0]
    assert again.num_cached_tokens >= len(prompts[0]) - BLOCK
    assert again.output_ids == cold[0]
