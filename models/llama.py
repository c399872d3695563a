"""Llama-family decoder (Llama, SmolLM, Mistral, Qwen2, Qwen3, Gemma 2/3, Phi-3 through config
flags: Q/K norms, per-layer sliding windows and RoPE bases, soft-capping, post-norms, GELU,
embedding scale, projections stored fused).

Only declares modules and the forward graph. The loader fills in the weights (and swaps in
the backend's quantized linear layers); every op runs through the layers, which ask the
`Backend` the model was built with.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from localllm.config import ModelConfig
from localllm.layers.activation import gelu_tanh_and_mul, silu_and_mul
from localllm.layers.attention import AttentionMetadata, AttentionSpec, KVCache
from localllm.layers.backend import Backend
from localllm.layers.linear import Linear, LinearBase, fuse_linears
from localllm.layers.norm import RMSNorm
from localllm.layers.rope import RotaryEmbedding
from localllm.layers.stack import DecoderLayout, LayerParts

REFINE_TOP = 16  # bf16 compute: logits of the best tokens recomputed in fp32
# ... of a head whose own logits are fine (`fine_logits`: within ~2e-3 on the default model,
# where the best and the fifth best were never closer than 0.29 in 1,081 decode steps)
REFINE_TOP_FINE = 4


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding, dtype: torch.dtype,
                 backend: Backend, spec: AttentionSpec) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.head_dim = hd = cfg.head_dim
        hidden, bias = cfg.hidden_size, cfg.attn_bias
        self.qkv_proj: LinearBase | None = None  # q, k, v stacked, once `fuse` succeeds
        if cfg.fused_projections:  # stored stacked: loaded as it is
            self.qkv_proj = Linear(hidden, (self.num_heads + 2 * self.num_kv_heads) * hd, bias,
                                   dtype, backend)
        else:
            self.q_proj: LinearBase = Linear(hidden, self.num_heads * hd, bias, dtype, backend)
            self.k_proj: LinearBase = Linear(hidden, self.num_kv_heads * hd, bias, dtype,
                                             backend)
            self.v_proj: LinearBase = Linear(hidden, self.num_kv_heads * hd, bias, dtype,
                                             backend)
        self.o_proj: LinearBase = Linear(self.num_heads * hd, hidden, False, dtype, backend)
        eps = cfg.rms_norm_eps
        self.q_norm = RMSNorm(hd, eps, dtype, backend) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, eps, dtype, backend) if cfg.qk_norm else None
        self.rope = rope
        self.backend = backend
        self.spec = spec

    def fuse(self) -> None:
        """After loading: stack q/k/v into one layer (one matmul per step instead of three)
        and drop the separate ones."""
        if self.qkv_proj is not None:
            return
        self.qkv_proj = fuse_linears([self.q_proj, self.k_proj, self.v_proj])
        if self.qkv_proj is not None:
            del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        # x: [num_tokens, hidden]
        t, hd = x.shape[0], self.head_dim
        nh, nkv = self.num_heads, self.num_kv_heads
        if self.qkv_proj is not None and self.q_norm is None:
            # q and k heads sit side by side in the fused output: one rotation for both
            flat = self.qkv_proj(x)  # [t, (n_heads + 2 * n_kv) * head_dim]
            qkv = flat.view(t, nh + 2 * nkv, hd)
            if self.rope.rotate_heads_(positions, flat, nh + nkv, hd):
                q, k, v = qkv[:, :nh], qkv[:, nh:nh + nkv], qkv[:, nh + nkv:]
            else:
                qk = self.rope.rotate(positions, qkv[:, :nh + nkv])
                q, k, v = qk[:, :nh], qk[:, nh:], qkv[:, nh + nkv:]
        else:
            if self.qkv_proj is not None:
                qf, kf, vf = self.qkv_proj(x).split((nh * hd, nkv * hd, nkv * hd), dim=-1)
            else:
                qf, kf, vf = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            q, k, v = qf.view(t, nh, hd), kf.view(t, nkv, hd), vf.view(t, nkv, hd)
            if self.q_norm is not None and self.k_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = self.rope(positions, q, k)
        o = self.backend.attention(q, k, v, cache, meta, self.spec)  # [t, nh, head_dim]
        return self.o_proj(o.reshape(t, nh * hd))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, backend: Backend) -> None:
        super().__init__()
        hidden, inter = cfg.hidden_size, cfg.intermediate_size
        self.gate_up_proj: LinearBase | None = None  # gate and up stacked, once `fuse` succeeds
        if cfg.fused_projections:
            self.gate_up_proj = Linear(hidden, 2 * inter, False, dtype, backend)
        else:
            self.gate_proj: LinearBase = Linear(hidden, inter, False, dtype, backend)
            self.up_proj: LinearBase = Linear(hidden, inter, False, dtype, backend)
        self.down_proj: LinearBase = Linear(inter, hidden, False, dtype, backend)
        self.gelu = cfg.hidden_act == "gelu_tanh"
        self.backend = backend

    def fuse(self) -> None:
        """After loading: stack gate and up into one layer, and drop the separate ones."""
        if self.gate_up_proj is not None:
            return
        self.gate_up_proj = fuse_linears([self.gate_proj, self.up_proj])
        if self.gate_up_proj is not None:
            del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            if self.gelu:
                return self.down_proj(self.backend.gelu_mul(self.gate_up_proj(x)))
            return self.down_proj(self.gate_up_proj.silu_gated(x))
        act = gelu_tanh_and_mul if self.gelu else silu_and_mul
        return self.down_proj(act(self.gate_proj(x), self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding, dtype: torch.dtype,
                 backend: Backend, spec: AttentionSpec) -> None:
        super().__init__()
        dim, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(dim, eps, dtype, backend)
        self.self_attn = Attention(cfg, rope, dtype, backend, spec)
        # Llama: the MLP's input norm; with post-norms (Gemma): the attention output's
        self.post_attention_layernorm = RMSNorm(dim, eps, dtype, backend)
        self.pre_feedforward_layernorm: RMSNorm | None = None
        self.post_feedforward_layernorm: RMSNorm | None = None
        if cfg.post_norms:
            self.pre_feedforward_layernorm = RMSNorm(dim, eps, dtype, backend)
            self.post_feedforward_layernorm = RMSNorm(dim, eps, dtype, backend)
        self.mlp = MLP(cfg, dtype, backend)

    @property
    def mlp_norm(self) -> RMSNorm:
        return self.pre_feedforward_layernorm or self.post_attention_layernorm

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                cache: KVCache, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        # x: this layer's input [num_tokens, hidden]: the embeddings (residual None) or the
        # previous layer's MLP output, still to be added into the residual stream.
        # Returns (MLP output, residual stream); the stream may be updated in place.
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn(h, positions, cache, meta)
        if self.pre_feedforward_layernorm is None:
            h, residual = self.post_attention_layernorm.add_forward(h, residual)
            return self.mlp(h), residual
        assert self.post_feedforward_layernorm is not None
        h, residual = self.pre_feedforward_layernorm.add_forward(
            self.post_attention_layernorm(h), residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, backend: Backend) -> None:
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype
        self.backend = backend
        # the embedding table is a Linear [vocab, hidden], so that a tied LM head is the same
        # module and the weight is held once, quantized or not
        self.embed_tokens: LinearBase = Linear(cfg.hidden_size, cfg.vocab_size, False, dtype,
                                               backend, exact_rows=True)
        self.rope = RotaryEmbedding(cfg, backend)
        # sliding layers with a RoPE base of their own (Gemma 3)
        self.rope_local = (RotaryEmbedding(cfg, backend, local=True) if cfg.rope_theta_local
                           else None)
        scale = cfg.query_scale or cfg.head_dim ** -0.5
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, self.rope_local if cfg.layer_window(i) and self.rope_local
                         else self.rope, dtype, backend,
                         AttentionSpec(scale, cfg.attn_softcap, cfg.layer_window(i)))
            for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, backend)
        self.lm_head: LinearBase = (
            self.embed_tokens if cfg.tie_word_embeddings
            else Linear(cfg.hidden_size, cfg.vocab_size, False, dtype, backend))

    def fuse_projections(self, after_layer: Callable[[], None] | None = None) -> None:
        """After loading: stack the projections that read the same input (see `fuse`).
        `after_layer` runs once each layer's parts are gone (the loader hands their freed
        memory back there, before the next layer allocates more)."""
        for layer in self.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
            if after_layer is not None:
                after_layer()

    def named_weights(self) -> dict[str, torch.Tensor]:
        """Every parameter under the name the loaders fill (`layers.0.self_attn.q_proj.weight`,
        ...), dense in the compute dtype: quantized weights dequantized, fused projections
        split back into their parts. For inspection and tests; it copies quantized weights."""
        out: dict[str, torch.Tensor] = {}
        for prefix, module in self.named_modules(remove_duplicate=False):
            parts: list[tuple[str, int]] = []
            if isinstance(module, Attention) and module.qkv_proj is not None:
                nq = module.num_heads * module.head_dim
                nkv = module.num_kv_heads * module.head_dim
                parts = [("q_proj", nq), ("k_proj", nkv), ("v_proj", nkv)]
                fused = module.qkv_proj
            elif isinstance(module, MLP) and module.gate_up_proj is not None:
                n = module.gate_up_proj.out_features // 2
                parts = [("gate_proj", n), ("up_proj", n)]
                fused = module.gate_up_proj
            elif isinstance(module, LinearBase):
                out[f"{prefix}.weight"] = module.dense_weight()
                if module.bias is not None:
                    out[f"{prefix}.bias"] = module.bias
                continue
            for name, p in module.named_parameters(recurse=False):
                out[f"{prefix}.{name}"] = p
            if parts:
                sizes = [n for _, n in parts]
                chunks = [fused.dense_weight().split(sizes)]
                if fused.bias is not None:
                    chunks.append(fused.bias.split(sizes))
                for kind, pieces in zip(("weight", "bias"), chunks):
                    for (name, _), piece in zip(parts, pieces):
                        out[f"{prefix}.{name}.{kind}"] = piece
        return out

    def decoder_layout(self) -> DecoderLayout:
        """The layers as data, for a backend's whole-step fast path (after loading)."""
        cfg = self.cfg
        parts = [LayerParts(layer.input_layernorm, layer.mlp_norm,
                            layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                            layer.mlp.gate_up_proj, layer.mlp.down_proj,
                            layer.self_attn.q_norm is not None, layer.self_attn.spec,
                            layer.self_attn.rope,
                            layer.post_attention_layernorm if cfg.post_norms else None,
                            layer.post_feedforward_layernorm, cfg.hidden_act)
                 for layer in self.layers]
        return DecoderLayout(self.embed_tokens, self.rope, parts, self.norm, self.dtype,
                             cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                             cfg.intermediate_size, cfg.embed_scale, self.lm_head,
                             self._refine_top(), cfg.final_softcap)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                caches: list[KVCache], meta: AttentionMetadata) -> torch.Tensor:
        # input_ids, positions: [num_tokens] -> hidden states [num_tokens, hidden]
        x = self.embed_tokens.embed(input_ids)
        if self.cfg.embed_scale != 1.0:  # rounded to the compute dtype first, as Gemma does
            x = x * torch.tensor(self.cfg.embed_scale, dtype=x.dtype)
        residual: torch.Tensor | None = None
        for layer, cache in zip(self.layers, caches):
            x, residual = layer(x, residual, positions, cache, meta)
        if residual is None:  # no layers
            return self.norm(x)
        return self.norm.add_forward(x, residual)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [num_seqs, hidden] -> [num_seqs, vocab] fp32
        logits = self.lm_head.logits(hidden)
        if self.dtype == torch.float32:
            return self._softcap(logits)
        # NOTE: bf16 logits are coarse (steps of 0.125 at 25), enough to tie or swap the top
        # tokens, and a head's own logits path rounds x (`int8_logits`: to 16 bits per group),
        # so the REFINE_TOP best (REFINE_TOP_FINE of a head whose logits are fine) are
        # recomputed in fp32 from the head's own weights (quantized: exactly as the file
        # dequantizes). Per row: batch size changes nothing.
        self.lm_head.refine_logits(logits, hidden, self.backend.top_k, self._refine_top())
        return self._softcap(logits)

    def _refine_top(self) -> int:
        """How many of the best logits `compute_logits` recomputes (0 in fp32)."""
        if self.dtype == torch.float32:
            return 0
        k = REFINE_TOP_FINE if self.lm_head.fine_logits else REFINE_TOP
        return min(k, self.lm_head.out_features)

    def _softcap(self, logits: torch.Tensor) -> torch.Tensor:
        cap = self.cfg.final_softcap
        return logits if cap == 0 else torch.tanh(logits / cap) * cap
