"""Tiny random checkpoints of every architecture variant, built by transformers, and the same
weights written as GGUF files the way llama.cpp's converter lays them out.

`build_hf(folder, case)` saves a fp32 model with random weights (norms included) and a small
byte-level BPE tokenizer.json; `write_gguf(folder, path, hf_model)` converts that checkpoint:
llama.cpp's tensor names, Q/K rows permuted for the adjacent-pair RoPE of `llama`/`mistral`,
Gemma's norm weights stored as 1 + w, Llama-3 scaling as `rope_freqs.weight`, LongRoPE as
`rope_factors_long/short`, the metadata keys llama.cpp reads, and the SPM test vocabulary of
`gguf_factory` (the model's vocabulary has as many rows).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import gguf.quants
import numpy as np
import torch
from gguf_factory import BOS_ID, EOS_ID, UNK_ID, VOCAB_SIZE, vocab

VOCAB = VOCAB_SIZE
BASE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=256,
            bos_token_id=None, eos_token_id=VOCAB - 1, pad_token_id=None)
WINDOW = 8  # sliding window of the windowed cases; the test sequences are several times longer
ORIGINAL = 16  # original_max_position_embeddings of the scaled-RoPE cases
GEMMA = dict(query_pre_attn_scalar=16, sliding_window=WINDOW, hidden_activation="gelu_pytorch_tanh")
# NOTE: the YaRN cases have a small RoPE base and small betas: at head_dim 16 and an original
# context of 16, the ramp's ends of any betas >= 2.5 both round to the same dimensions
CASES: dict[str, tuple[str, dict[str, Any]]] = {  # name: (transformers class prefix, config)
    "llama-llama3": ("Llama", {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": ORIGINAL}}),
    "llama-linear": ("Llama", {"rope_parameters": {"rope_type": "linear", "factor": 4.0,
                                                   "rope_theta": 10000.0}}),
    "llama-yarn-custom": ("Llama", {"rope_parameters": {
        "rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0, "beta_fast": 1.0,
        "beta_slow": 0.25, "attention_factor": 1.3,
        "original_max_position_embeddings": ORIGINAL}}),
    "qwen2-yarn-mscale": ("Qwen2", {"rope_parameters": {
        "rope_type": "yarn", "rope_theta": 100.0, "factor": 8.0, "beta_fast": 1.25,
        "beta_slow": 0.5, "mscale": 1.5, "mscale_all_dim": 0.5,
        "original_max_position_embeddings": ORIGINAL}}),
    "mistral-window": ("Mistral", {"sliding_window": WINDOW}),
    "gemma2": ("Gemma2", {**GEMMA, "attn_logit_softcapping": 1.0,
                          "final_logit_softcapping": 2.0, "tie_word_embeddings": True}),
    "gemma3": ("Gemma3", {**GEMMA, "num_hidden_layers": 6, "tie_word_embeddings": True,
                          "rope_parameters": {
                              "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                              "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                 "rope_theta": 1000000.0}}}),
    "phi3-longrope": ("Phi3", {"max_position_embeddings": 64,
                               "original_max_position_embeddings": ORIGINAL, "rope_parameters": {
                                   "rope_type": "longrope", "rope_theta": 10000.0,
                                   "partial_rotary_factor": 0.5,
                                   "short_factor": [1.0, 1.2, 1.5, 2.0],
                                   "long_factor": [1.0, 2.0, 4.0, 8.0]}}),
}
GGUF_ARCH = {"Llama": "llama", "Qwen2": "qwen2", "Mistral": "mistral", "Gemma2": "gemma2",
             "Gemma3": "gemma3", "Phi3": "phi3"}


def tokenizer(folder: Path, vocab: int = VOCAB) -> None:
    """A byte-level BPE tokenizer.json with exactly `vocab` tokens, `<|endoftext|>` last (as
    many tokens as the embedding has rows: localllm's detokenizer cannot show ids past the
    tokenizer's vocabulary, while real checkpoints often pad the embedding)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab - 1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the cat sat on the mat, hi there"] * 50, trainer)
    tok.add_tokens([f"<extra_{i}>" for i in range(vocab - 1 - tok.get_vocab_size())])
    tok.add_special_tokens(["<|endoftext|>"])
    assert tok.get_vocab_size() == vocab and tok.token_to_id("<|endoftext|>") == vocab - 1
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))


def build_hf(folder: Path, case: str, **overrides: Any) -> None:
    import transformers

    prefix, extra = CASES[case]
    extra = {**extra, **overrides}
    conf_cls = getattr(transformers, f"{prefix}TextConfig" if prefix == "Gemma3" else
                       f"{prefix}Config")
    cfg = conf_cls(**{**BASE, **extra})
    torch.manual_seed(sum(map(ord, case)))
    model = getattr(transformers, f"{prefix}ForCausalLM")(cfg)
    gemma = prefix.startswith("Gemma")
    with torch.no_grad():
        for name, p in model.named_parameters():
            norm = "norm" in name
            # Gemma's norms multiply by (1 + w): w near 0 is a weight near 1
            p.normal_(1.0 if norm and not gemma else 0.0, 0.1 if norm else 0.15)
    model.save_pretrained(folder)
    tokenizer(folder)


def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of each head from halves order to adjacent pairs (llama.cpp's converter)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def _gguf_name(name: str, arch: str) -> str | None:
    fixed = {"model.embed_tokens.weight": "token_embd.weight",
             "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
    if name in fixed:
        return fixed[name]
    parts = name.split(".")
    if parts[:2] != ["model", "layers"]:
        return None
    gemma = arch.startswith("gemma")
    blocks = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "self_attn.qkv_proj": "attn_qkv",
        "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
        "post_attention_layernorm": "post_attention_norm" if gemma else "ffn_norm",
        "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
        "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
        "mlp.gate_up_proj": "ffn_up",
    }
    module = ".".join(parts[3:-1])
    return f"blk.{parts[2]}.{blocks[module]}.{parts[-1]}"


def write_gguf(folder: Path, path: Path, hf_model: torch.nn.Module, q8: bool = False) -> Path:
    """The checkpoint in `folder` as a GGUF file at `path` (fp32 tensors; `q8`: matrices as
    Q8_0); `hf_model` is the loaded transformers model (its RoPE module gives Llama-3 factors
    and the attention factor, as the converter computes them)."""
    from safetensors.torch import load_file

    cfg = json.loads((folder / "config.json").read_text())
    prefix = next(p for p, a in GGUF_ARCH.items() if cfg["architectures"][0].startswith(p))
    arch = GGUF_ARCH[prefix]
    w = gguf.GGUFWriter(str(path), arch)
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg["head_dim"] if "head_dim" in cfg else cfg["hidden_size"] // heads
    rope = cfg.get("rope_parameters") or {}
    if arch == "gemma3":
        rope = rope["full_attention"]
    rope_dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    w.add_rope_dimension_count(rope_dim)
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    if cfg.get("sliding_window"):
        w.add_sliding_window(cfg["sliding_window"])
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key):
            w.add_float32(f"{arch}.{key}", float(cfg[key]))
    kind = rope.get("rope_type", "default")
    tensors: dict[str, np.ndarray] = {}
    rotary = hf_model.model.rotary_emb
    if kind == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(rope["factor"]))
    elif kind == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(rope["factor"]))
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(float(rope["beta_fast"]))
        w.add_rope_scaling_yarn_beta_slow(float(rope["beta_slow"]))
        w.add_rope_scaling_yarn_attn_factor(float(rotary.attention_scaling))
    elif kind == "llama3":
        base = 1.0 / (rope["rope_theta"] ** (torch.arange(0, rope_dim, 2).double() / rope_dim))
        tensors["rope_freqs.weight"] = (base / rotary.inv_freq.double()).float().numpy()
    elif kind == "longrope":
        w.add_rope_scaling_orig_ctx_len(cfg["original_max_position_embeddings"])
        w.add_float32(f"{arch}.rope.scaling.attn_factor", float(rotary.attention_scaling))
        for which in ("long", "short"):
            tensors[f"rope_factors_{which}.weight"] = np.array(rope[f"{which}_factor"],
                                                                np.float32)
    tokens, scores, types = vocab()
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_unk_token_id(UNK_ID)
    for name, t in load_file(str(folder / "model.safetensors")).items():
        target = _gguf_name(name, arch)
        if target is None:
            continue
        t = t.float()
        if arch in ("llama", "mistral") and name.endswith("q_proj.weight"):
            t = _permute(t, heads)
        elif arch in ("llama", "mistral") and name.endswith("k_proj.weight"):
            t = _permute(t, kv)
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            t = t + 1.0
        tensors[target] = t.numpy()
    for name, array in tensors.items():
        if q8 and array.ndim == 2:
            qt = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(name, gguf.quants.quantize(array, qt), raw_dtype=qt)
        else:
            w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
