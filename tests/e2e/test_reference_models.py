"""Exactness against the reference systems on real models.

- Logits (fp32 compute) vs Hugging Face transformers in fp32 on the same dequantized weights.
- Greedy text vs transformers on the default model and vs llama.cpp on stories260K (F32).
llama.cpp quantizes activations inside quantized matmuls, so on the default model its logits
are reported for information only (see DESIGN.md).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from llama_ref import llama_greedy, llama_logits

from localllm import LLM, SamplingParams
from localllm.engine.model_runner import prompt_logits

TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based ink and a wooden screw press into a "
    "system that could produce books far faster than any scribe. Within fifty years, presses "
    "had spread to more than two hundred cities across Europe, and millions of volumes were in "
    "circulation. Scholars argue about the consequences: literacy rose, scientific results "
    "could be checked and copied without errors creeping in, and religious and political ideas "
    "travelled faster than the authorities could suppress them. Printing also standardised "
    "spelling and grammar, because printers needed consistent conventions for their type. "
    "Today the same questions are asked about the internet and about language models."
)
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "Once upon a time, a small robot",
    "Water boils at",
]


@pytest.fixture(scope="module")
def ours_fp32(smollm_path: Path) -> LLM:
    return LLM(smollm_path, dtype="float32")


@pytest.fixture(scope="module")
def hf_model(smollm_path: Path) -> torch.nn.Module:
    """The default model through transformers (its GGUF loader), in fp32."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm_path.parent), gguf_file=smollm_path.name, dtype=torch.float32).eval()


def test_logits_match_transformers_fp32(ours_fp32: LLM, hf_model) -> None:
    ids = ours_fp32.encode(TEXT)
    assert len(ids) >= 128
    ours = prompt_logits(ours_fp32.loaded.model, ids)  # [T, vocab]
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].float()
    agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    max_diff = (ours - ref).abs().max().item()
    print(f"\n{len(ids)} tokens: top-1 agreement {agree:.4%}, max |logit diff| {max_diff:.2e}")
    assert agree >= 0.999
    assert max_diff < 1e-2


def test_greedy_text_matches_transformers(ours_fp32: LLM, hf_model) -> None:
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    outs = ours_fp32.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outs):
        ids = ours_fp32.encode(prompt)
        with torch.no_grad():
            # plain greedy for 32 tokens: no EOS stop, no EOS suppression
            ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        assert out.token_ids == ref, f"prompt {prompt!r}"


def test_llama_cpp_agreement_is_reported(ours_fp32: LLM, smollm_path: Path) -> None:
    pytest.importorskip("llama_cpp")
    ids = ours_fp32.encode(TEXT)
    theirs = torch.from_numpy(llama_logits(smollm_path, ids))
    ours = prompt_logits(ours_fp32.loaded.model, ids)
    agree = (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item()
    print(f"\nllama.cpp vs localllm fp32 top-1 agreement: {agree:.2%} (information only)")
    assert agree > 0.8  # llama.cpp quantizes activations; far lower would mean a real bug


def test_stories_greedy_matches_llama_cpp(stories_path: Path) -> None:
    pytest.importorskip("llama_cpp")
    ours = LLM(stories_path, dtype="float32")
    for prompt in ["Once upon a time", "The little dog", "Tom and Lily went to the park"]:
        ids = ours.encode(prompt)
        expected = llama_greedy(stories_path, ids, 48)
        out = ours.generate([ids], SamplingParams(max_tokens=48, temperature=0,
                                                  ignore_eos=True))[0]
        assert out.token_ids == expected, f"prompt {prompt!r}"


def test_chunked_teacher_forcing_equals_one_prefill(stories_path: Path) -> None:
    llm = LLM(stories_path, dtype="float32")
    ids = llm.encode("Once upon a time there was a little girl named Lily who loved the park.")
    whole = prompt_logits(llm.loaded.model, ids)
    for chunk in (1, 5):
        torch.testing.assert_close(prompt_logits(llm.loaded.model, ids, chunk=chunk), whole,
                                   rtol=1e-4, atol=1e-4)
