"""Every architecture variant against transformers fp32, from the HF checkpoint and from a GGUF
file of the same weights (`tests/variant_models.py`): Llama-3, linear and YaRN RoPE scaling
(custom betas, attention factor, mscale), Mistral's sliding window, Gemma 2 (soft-caps,
alternating local/global layers, post-norms, GELU, embedding scale), Gemma 3 (Q/K norms, 5:1
local/global layers with their own RoPE bases), Phi-3 (fused projections, LongRoPE, partial
rotary). The sequences cross the sliding window (8) and the original context (16) several
times over.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from variant_models import CASES, ORIGINAL, VOCAB, WINDOW, build_hf, write_gguf

from localllm import LLM, SamplingParams
from localllm.engine.model_runner import prompt_logits

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_torch_thread")
transformers.utils.logging.disable_progress_bar()

SEQ = 56  # 7 windows, 3.5 original contexts
PROMPT, NEW = 20, 12  # greedy: a prompt past the original context, then a window and more


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path, object]]:
    """case -> (HF folder, GGUF file, transformers model in fp32)."""
    out = {}
    for case in CASES:
        folder = tmp_path_factory.mktemp(case)
        build_hf(folder, case)
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32).eval()
        out[case] = (folder, write_gguf(folder, folder.parent / f"{case}.gguf", hf), hf)
    return out


def _ids(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


def _hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(_hf_logits(model, seq)[-1].argmax()))
    return seq[len(prompt):]


@pytest.mark.parametrize("source", ["hf", "gguf"])
@pytest.mark.parametrize("case", list(CASES))
def test_fp32_logits_and_greedy_match_transformers(built, case: str, source: str) -> None:
    folder, gguf_path, hf = built[case]
    llm = LLM(folder if source == "hf" else gguf_path, dtype="float32")
    cfg = llm.config
    if "window" in case or "gemma" in case:
        assert cfg.sliding_window == WINDOW and cfg.context_length > WINDOW
    ids = _ids(SEQ)
    ref = _hf_logits(hf, ids)
    ours = prompt_logits(llm.loaded.model, ids)
    diff = (ours - ref).abs().max().item()
    assert diff < 1e-4 * max(1.0, ref.abs().max().item()), (case, source, diff)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    # one token at a time (decode steps) gives the same logits
    stepped = prompt_logits(llm.loaded.model, ids, block_size=4, chunk=1)
    assert (stepped - ref).abs().max().item() < 1e-4 * max(1.0, ref.abs().max().item())
    prompt = ids[:PROMPT]
    out = llm.generate([prompt], SamplingParams(max_tokens=NEW, temperature=0,
                                                ignore_eos=True))[0]
    assert out.token_ids == _hf_greedy(hf, prompt, NEW)


def test_the_variants_reach_the_model(built) -> None:
    """What each case is meant to exercise is really in its config (so a parser that drops a
    key cannot pass the comparison by accident)."""
    cfgs = {case: LLM(built[case][0], dtype="float32").config for case in
            ("llama-yarn-custom", "qwen2-yarn-mscale", "gemma2", "gemma3", "phi3-longrope")}
    yarn = cfgs["llama-yarn-custom"].rope_scaling
    assert (yarn.beta_fast, yarn.beta_slow, yarn.attention_factor) == (1.0, 0.25, 1.3)
    assert cfgs["qwen2-yarn-mscale"].rope_scaling.attention_factor == pytest.approx(
        (0.1 * 1.5 * torch.tensor(8.0).log().item() + 1)
        / (0.1 * 0.5 * torch.tensor(8.0).log().item() + 1))
    g2 = cfgs["gemma2"]
    assert (g2.attn_softcap, g2.final_softcap, g2.sliding_layers) == (1.0, 2.0, (True, False))
    g3 = cfgs["gemma3"]
    assert g3.sliding_layers == (True,) * 5 + (False,) and g3.rope_theta_local == 10000.0
    assert g3.qk_norm and g3.rope_scaling.kind == "linear"
    phi = cfgs["phi3-longrope"]
    assert (phi.rope_scaling.kind, phi.rope_scaling.original_context, phi.rope_dim) == (
        "longrope", ORIGINAL, 8)


@pytest.mark.parametrize("case", list(CASES))
def test_bf16_follows_fp32(built, case: str) -> None:
    """bf16 compute (the CPU backend's native small ops where they run; windowed or
    soft-capped attention in PyTorch) stays near transformers' fp32 logits."""
    folder, _, hf = built[case]
    llm = LLM(folder, dtype="bfloat16")
    ids = _ids(SEQ, seed=3)
    ref = _hf_logits(hf, ids)
    for chunk in (0, 1):
        ours = prompt_logits(llm.loaded.model, ids, chunk=chunk)
        rel = ((ours - ref).norm() / ref.norm()).item()
        top1 = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
        assert rel < 0.05 and top1 > 0.9, (case, chunk, rel, top1)


def test_whole_step_fast_path_only_for_plain_layers(tmp_path: Path) -> None:
    """The native one-call decode stays on for Llama-style layers (Phi-3's too: fused
    projections, LongRoPE and partial rotary are in the tables and shapes it takes) and is
    declined for layers whose features it lacks (window, soft-cap, post-norms, GELU, two RoPE
    bases)."""
    from localllm.backends.cpu.whole_step import build_stack
    from localllm.kernels import cpu_native

    for case in CASES:
        # Q8_0 matrices the stack packs, with 64-row K/V projections it can stack with Q
        folder = tmp_path / case
        folder.mkdir()
        build_hf(folder, case, num_key_value_heads=4)
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder)
        path = write_gguf(folder, folder / "q8.gguf", hf, q8=True)
        model = LLM(path, dtype="bfloat16").loaded.model
        layout = model.decoder_layout()
        assert layout.plain() == case.startswith(("llama", "qwen2", "phi3")), case
        # qwen2's Q/K/V biases keep it off the stack, as before
        fast = case.startswith(("llama", "phi3")) and cpu_native.available()
        assert (build_stack(layout) is not None) == fast, case
        if fast:  # decode steps through the stack compute the same model
            ids = _ids(SEQ, seed=4)
            ref = _hf_logits(hf.float().eval(), ids)
            ours = prompt_logits(model, ids, chunk=1)
            assert ((ours - ref).norm() / ref.norm()).item() < 0.05, case


def test_multimodal_gemma3_checkpoint_loads_its_text_model(tmp_path: Path) -> None:
    """Gemma 3 4B+ checkpoints are `Gemma3ForConditionalGeneration`: the text model's config
    sits in `text_config` (perhaps only what differs from the defaults) and its tensors under
    `language_model.model.` (as saved) or `model.language_model.` (transformers 5's module
    names); the vision tower is ignored. Text-only logits equal transformers'."""
    import json

    from safetensors.torch import load_file, save_file
    from variant_models import BASE, GEMMA, tokenizer

    text = transformers.Gemma3TextConfig(**{**BASE, **GEMMA, "num_hidden_layers": 6})
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=1, num_attention_heads=2,
                                             image_size=28, patch_size=14)
    cfg = transformers.Gemma3Config(text_config=text, vision_config=vision,
                                    mm_tokens_per_image=4)
    torch.manual_seed(5)
    hf = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(0.0, 0.1 if "norm" in name else 0.15)
    saved = tmp_path / "saved"
    hf.save_pretrained(saved)
    tokenizer(saved)
    ids = _ids(SEQ, seed=6)
    ref = _hf_logits(hf, ids)
    tensors = load_file(str(saved / "model.safetensors"))
    assert any(n.startswith("language_model.model.layers.") for n in tensors)
    renamed = tmp_path / "renamed"  # transformers 5's in-memory names, and a sparse config
    renamed.mkdir()
    save_file({n.replace("language_model.model.", "model.language_model."): t
               for n, t in tensors.items()}, str(renamed / "model.safetensors"))
    raw = json.loads((saved / "config.json").read_text())
    for key in ("rms_norm_eps", "hidden_activation", "rope_parameters", "layer_types"):
        del raw["text_config"][key]  # the defaults give the same
    (renamed / "config.json").write_text(json.dumps(raw))
    tokenizer(renamed)
    for folder in (saved, renamed):
        llm = LLM(folder, dtype="float32")
        assert llm.config.arch == "gemma3" and llm.config.sliding_layers[-1] is False
        ours = prompt_logits(llm.loaded.model, ids)
        assert (ours - ref).abs().max().item() < 1e-4 * max(1.0, ref.abs().max().item())
