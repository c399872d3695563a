"""Decode steps through one native call for the whole decoder stack (`DecoderStack`).

A step where every sequence has one new token, in bf16, with every projection held as a packed
int4/int8 weight of this backend, no biases and no Q/K norms, in a Llama-style model
(`DecoderLayout.plain`: no soft-cap, sliding window, post-norms, GELU or embedding scale, which
the native stack lacks), skips the per-module Python path:
`build` describes the model's layers (`DecoderLayout`) to the native kernel once, and the
returned step runs each such step with one call. The kernel calls the same native functions as
the per-op path, in the same order, so tokens come out identical either way (a step mixing
prompts and decodes, or with more sequences than the stack takes, returns None: the per-op
path runs it). Where the model's LM head is a Q8_0 weight whose logits `int8_logits` computes
(`CpuPackedWeight.fine_logits`), without bias or soft-cap, the same call runs the head too
(logits, the refine of the best, each row's argmax): `StepLogits` for a step asked for them;
and an embedding with fp16 scales (Q8_0, Q4_0, Q5_0) has its rows looked up in it as well.
"""

from __future__ import annotations

import torch

from localllm.backends.cpu.attention import decode_batch
from localllm.backends.cpu.dispatch import NATIVE_KERNEL_MAX_ROWS
from localllm.backends.cpu.weights import CpuPackedWeight
from localllm.kernels import cpu_layers, cpu_native, cpu_ops
from localllm.kernels.cpu_int4 import NATIVE_LAYOUT
from localllm.layers.attention import AttentionMetadata, KVCache
from localllm.layers.backend import DecodeSteps, RowDraw, StepLogits, StepTokens, WholeStep
from localllm.layers.linear import LinearBase, QuantLinear
from localllm.layers.stack import DecoderLayout


def _packed(lin: LinearBase | None) -> cpu_layers.PackedLinear | None:
    if (not isinstance(lin, QuantLinear) or lin.bias is not None
            or not isinstance(lin.qweight, CpuPackedWeight)
            or lin.qweight.layout != NATIVE_LAYOUT):
        return None
    q = lin.qweight
    return cpu_layers.PackedLinear(q.packed, q.scales_zeros, q.in_features, q.out_features,
                                   q.planes, q.group_size, q.lut)


def _head(layout: DecoderLayout) -> cpu_layers.StackHead | None:
    """The LM head as the stack runs it, or None where `compute_logits` does more (or other)
    than int8_logits, its refine and nothing after."""
    lin = layout.lm_head
    packed = _packed(lin)
    if (packed is None or layout.final_softcap != 0 or layout.refine_top < 1
            or not isinstance(lin, QuantLinear) or not lin.qweight.fine_logits):
        return None
    return cpu_layers.StackHead(packed, layout.refine_top)


def _embed(layout: DecoderLayout) -> cpu_layers.PackedLinear | None:
    """The embedding as the stack looks its rows up (`int4_rows_half`, as `QuantLinear.embed`
    does for a weight with fp16 scales), or None where the embedding is another kind."""
    lin = layout.embed
    if not isinstance(lin, QuantLinear) or not isinstance(lin.qweight, CpuPackedWeight):
        return None
    if not lin.qweight.half or lin.qweight.codebook is not None:
        return None
    return _packed(lin)


def build_stack(layout: DecoderLayout) -> cpu_layers.DecoderStack | None:
    """The layers as a `DecoderStack`, or None when a layer does not fit it."""
    if (layout.dtype != torch.bfloat16 or not cpu_native.available() or not layout.layers
            or not layout.plain()):
        return None
    layers = []
    for layer in layout.layers:
        parts = [_packed(layer.qkv), _packed(layer.o), _packed(layer.gate_up),
                 _packed(layer.down)]
        if layer.qk_norm or any(p is None for p in parts):
            return None
        qkv, o, gate_up, down = parts
        assert qkv is not None and o is not None and gate_up is not None and down is not None
        layers.append(cpu_layers.StackLayer(layer.input_norm.weight.data,
                                            layer.post_norm.weight.data,
                                            qkv, o, gate_up, down))
    eps = {layer.input_norm.eps for layer in layout.layers} | {
        layer.post_norm.eps for layer in layout.layers} | {layout.final_norm.eps}
    dims = cpu_layers.StackDims(layout.hidden_size, layout.num_heads, layout.num_kv_heads,
                                layout.head_dim, layout.rope.rope_dim, layout.rope.neox,
                                layout.intermediate_size, eps.pop(),
                                layout.layers[0].attn.scale)
    if eps:  # one epsilon for all norms
        return None
    # decoding rows take int4_mm in the per-op path at any count (`decode_rows`), so both
    # paths agree up to the stack's limit
    args = (layers, layout.final_norm.weight.data, dims, NATIVE_KERNEL_MAX_ROWS)
    # DecoderStack checks the rest (head sizes the attention kernel takes, shapes); without the
    # embedding or the head where it does not take theirs
    lm_head, rows = _head(layout), _embed(layout)
    for head, embed in ((lm_head, rows), (lm_head, None), (None, None)):
        try:
            return cpu_layers.DecoderStack(*args, head=head, embed=embed)
        except ValueError:
            pass
    return None


# what a native call takes besides the step's tokens: positions, slots, block tables, context
# lengths, each layer's (K, V) pools, cos, sin
StepArgs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                 list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor, torch.Tensor]


class _Operands:
    """The operands of a fast path's native calls over one stack: the decoding batch, the RoPE
    tables and the K/V pools (one list while the caches stay the same, so that the stack keeps
    its pointers)."""

    def __init__(self, stack: cpu_layers.DecoderStack, layout: DecoderLayout) -> None:
        self.stack, self.layout = stack, layout
        self._pools: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._pools_of: list[KVCache] | None = None  # the caches `_pools` was made from

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[KVCache],
                 meta: AttentionMetadata, ahead: int = 0) -> StepArgs | None:
        """A decode-only step's `StepArgs`, the RoPE tables reaching `ahead` positions past
        its last; None where the stack does not take the step (or the kernels do not run)."""
        if input_ids.device.type != "cpu" or not cpu_native.available():
            return None
        batch = meta.plan(decode_batch)
        if batch is None or batch.rows is not None or len(batch.seqs) > self.stack.max_rows:
            return None
        cos, sin = self.layout.rope.tables(max(meta.context_lens) + ahead, positions.device)
        if self._pools_of is not caches or self._pools[0][0] is not caches[0].k:
            self._pools, self._pools_of = [(c.k, c.v) for c in caches], caches
        return (positions, meta.slot_mapping, batch.block_tables, batch.context_lens,
                self._pools, cos, sin)


def build(layout: DecoderLayout) -> WholeStep | None:
    """The whole-step fast path of the model `layout` describes, or None when it does not fit
    the native stack (or the kernels do not run here)."""
    stack = build_stack(layout)
    if stack is None:
        return None
    operands = _Operands(stack, layout)

    def step(input_ids: torch.Tensor, positions: torch.Tensor, caches: list[KVCache],
             meta: AttentionMetadata, head: bool = False) -> torch.Tensor | StepLogits | None:
        # input_ids, positions: [num_seqs] -> final hidden states [num_seqs, hidden], or with
        # head (and a stack that has one) the logits
        args = operands(input_ids, positions, caches, meta)
        if args is None:
            return None
        head = head and stack.head is not None
        if stack.embed is not None:  # the embedding rows looked up in the same call
            out = stack.run_tokens(input_ids, *args, head)
            return StepLogits(*out) if isinstance(out, tuple) else out
        x = layout.embed.embed(input_ids)
        return StepLogits(*stack.run_logits(x, *args)) if head else stack.run(x, *args)

    return step


def build_steps(layout: DecoderLayout) -> DecodeSteps | None:
    """Several decode steps of the model `layout` describes in one native call, greedy or
    sampled with top-k (drawn in the call as the engine's Sampler draws), or None where the
    stack lacks the head or the embedding that the call needs to feed each step's tokens to
    the next (or does not fit the model)."""
    stack = build_stack(layout)
    if stack is None or stack.head is None or stack.embed is None:
        return None
    operands = _Operands(stack, layout)

    def steps(input_ids: torch.Tensor, positions: torch.Tensor, caches: list[KVCache],
              meta: AttentionMetadata, n: int, draws: list[RowDraw | None]) -> StepTokens | None:
        # input_ids, positions: [num_seqs], the first step's; the last step's positions are
        # n - 1 on
        args = operands(input_ids, positions, caches, meta, n - 1)
        if args is None:
            return None
        rows = None if all(d is None for d in draws) else [
            cpu_ops.RowSampling() if d is None else cpu_ops.RowSampling(
                d.temperature, d.top_p, d.min_p, d.top_k, d.key, d.count) for d in draws]
        return StepTokens(*stack.run_steps(input_ids, *args, n, rows))

    return DecodeSteps(steps, stack.max_rows, cpu_ops.SAMPLE_MAX_K)
