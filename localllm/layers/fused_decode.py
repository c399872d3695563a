"""Decode steps through one native call for the whole decoder stack (`DecoderStack`).

A step where every sequence has one new token, on the CPU in bf16, with every projection held
as a packed int4/int8 weight, no biases and no Q/K norms, skips the per-module Python path:
`FusedDecode` describes the model's layers to the native kernel once, then runs each such step
with one call. The kernel calls the same native functions as the per-op path, in the same order,
so tokens come out identical either way (a step mixing prompts and decodes takes the per-op path).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from localllm.kernels import cpu_native
from localllm.layers.attention import (
    AttentionBackend,
    AttentionMetadata,
    KVCache,
    TorchPagedAttention,
)
from localllm.layers.cpu_packed import NATIVE_KERNEL_MAX_ROWS, CpuPackedWeight
from localllm.layers.linear import Linear

if TYPE_CHECKING:
    from localllm.models.llama import LlamaForCausalLM


def _packed(lin: Linear | None) -> cpu_native.PackedLinear | None:
    if lin is None or lin.bias is not None or not isinstance(lin.qweight, CpuPackedWeight):
        return None
    q = lin.qweight
    return cpu_native.PackedLinear(q.packed, q.scales_zeros, q.in_features, q.out_features,
                                   q.planes, q.group_size, q.lut)


def build_stack(model: LlamaForCausalLM) -> cpu_native.DecoderStack | None:
    """The model's layers as a `DecoderStack`, or None when a layer does not fit it."""
    if model.dtype != torch.bfloat16 or not cpu_native.available() or not model.layers:
        return None
    cfg = model.cfg
    layers = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        parts = [_packed(attn.qkv_proj), _packed(attn.o_proj), _packed(mlp.gate_up_proj),
                 _packed(mlp.down_proj)]
        if attn.q_norm is not None or any(p is None for p in parts):
            return None
        qkv, o, gate_up, down = parts
        assert qkv is not None and o is not None and gate_up is not None and down is not None
        layers.append(cpu_native.StackLayer(layer.input_layernorm.weight.data,
                                            layer.post_attention_layernorm.weight.data,
                                            qkv, o, gate_up, down))
    eps = {layer.input_layernorm.eps for layer in model.layers} | {
        layer.post_attention_layernorm.eps for layer in model.layers} | {model.norm.eps}
    attn0 = model.layers[0].self_attn
    dims = cpu_native.StackDims(cfg.hidden_size, attn0.n_heads, attn0.n_kv, attn0.hd,
                                model.rope.rope_dim, model.rope.neox, cfg.intermediate_size,
                                eps.pop(), attn0.scale)
    if eps:  # one epsilon for all norms
        return None
    try:  # DecoderStack checks the rest (head sizes the attention kernel takes, shapes)
        # decoding rows take int4_mm in the per-op path at any count (`decode_rows`), so both
        # paths agree up to the stack's limit
        return cpu_native.DecoderStack(layers, model.norm.weight.data, dims,
                                       NATIVE_KERNEL_MAX_ROWS)
    except ValueError:
        return None


class FusedDecode:
    """Runs the decode-only steps of one model through its `DecoderStack`. The stack is built
    on first use (after loading has set and fused the weights, which must not change after)
    and points at the weights; a model that does not fit never takes this path."""

    def __init__(self) -> None:
        self._stack: cpu_native.DecoderStack | None = None
        self._built = False

    def __call__(self, model: LlamaForCausalLM, input_ids: torch.Tensor,
                 positions: torch.Tensor, caches: list[KVCache], meta: AttentionMetadata,
                 backend: AttentionBackend) -> torch.Tensor | None:
        """Final hidden states [num_tokens, hidden], or None when this step is not for it
        (another attention backend, a prompt in the step, too many sequences)."""
        if not isinstance(backend, TorchPagedAttention):
            return None
        if not self._built:
            self._stack, self._built = build_stack(model), True
        stack = self._stack
        if stack is None or input_ids.device.type != "cpu":
            return None
        batch = meta.decode_batch()
        if batch is None or batch.rows is not None or len(batch.seqs) > stack.max_rows:
            return None
        cos, sin = model.rope.tables(max(meta.context_lens), positions.device)
        x = model.embed_tokens.embed(input_ids)
        return stack.run(x, positions, meta.slot_mapping, batch.block_tables,
                         batch.context_lens, [(c.k, c.v) for c in caches], cos, sin)
