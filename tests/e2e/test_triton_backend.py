"""The Triton backend end to end on a real model: under TRITON_INTERPRET=1 (set by conftest.py
where there is no CUDA GPU) its kernels run on CPU tensors, and greedy text must equal the CPU
backend's, for a lone prompt, a batch whose prompts share a cached prefix, and chunked prompts.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from localllm import LLM, SamplingParams
from localllm.apps.cli import main as cli_main
from localllm.config import SchedulerConfig

pytest.importorskip("triton")

GREEDY = SamplingParams(max_tokens=12, temperature=0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_generate_prints_the_cpu_backends_greedy_text(stories_path: Path, dtype: str,
                                                      capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    texts = {}
    for backend in ("cpu", "triton"):
        rc = cli_main(["generate", "--model", str(stories_path), "--dtype", dtype,
                       "--backend", backend, "--temperature", "0", "--max-tokens", "16",
                       "Once upon a time"])
        out = capsys.readouterr()
        assert rc == 0, out.err
        assert f"{backend} backend on cpu" in out.err
        texts[backend] = out.out
    assert texts["triton"] == texts["cpu"] and len(texts["cpu"].split()) > 5


def test_cached_prefix_and_chunked_prompts_match_the_cpu_backend(stories_path: Path) -> None:
    # 55 shared tokens: three full blocks of the second prompt come from the prefix cache; a
    # 24-token step budget splits the longer prompts into chunks
    shared = ("Once upon a time there was a little girl named Lily. She loved to play outside "
              "in the park with her friends. One day, she saw a big red ball under a tree. ")
    prompts = [shared + "She ran to it.", shared + "It was shiny.", "The cat sat"]
    outs = {}
    for backend in ("cpu", "triton"):
        llm = LLM(stories_path, dtype="float32", backend=backend,
                  scheduler=SchedulerConfig(max_num_batched_tokens=24))
        first = llm.generate(prompts[0], GREEDY)
        rest = llm.generate(prompts[1:], GREEDY)
        assert llm.engine.bm.prefix_hits >= 48  # the shared prefix's full blocks
        outs[backend] = [c.token_ids for c in first + rest]
    assert outs["triton"] == outs["cpu"]
