"""The whole decoder stack of a decode step in one call (`cpu_layers.c`): `DecoderStack`
describes a model's layers (and optionally its embedding and its Q8_0 LM head, `StackHead`)
to `decode_layers` once (ctypes structs pointing at the weights), then runs each step;
`DecoderStack.run_ref` and `run_logits_ref` are the plain-PyTorch references."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from localllm.kernels import cpu_native
from localllm.kernels.cpu_int4 import (
    HALF,
    REFINE_MAX,
    TILE,
    _lut_ptr,
    int4_mm_ref,
    int4_refine_half_ref,
    int8_logits_ref,
    scales_form,
    scales_layout,
)
from localllm.kernels.cpu_ops import (
    RowSampling,
    decode_attention_ref,
    decode_attention_supported,
    kv_store_ref,
    rms_norm_ref,
    rope_ref,
    sampling_rows,
    silu_mul_ref,
    top_k_ref,
)

GROUP = 32


class _PackedWeight(ctypes.Structure):
    _fields_ = [("packed", ctypes.c_void_p), ("sz", ctypes.c_void_p),
                ("out_features", ctypes.c_int64), ("out_padded", ctypes.c_int64),
                ("planes", ctypes.c_int64), ("group_size", ctypes.c_int64),
                ("lut", ctypes.c_void_p), ("scales_form", ctypes.c_int64)]


class _DecoderLayer(ctypes.Structure):
    _fields_ = [("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p),
                ("qkv", _PackedWeight), ("o", _PackedWeight), ("gate_up", _PackedWeight),
                ("down", _PackedWeight), ("k_pool", ctypes.c_void_p),
                ("v_pool", ctypes.c_void_p)]


class _StepHead(ctypes.Structure):
    _fields_ = [("w", _PackedWeight), ("refine_k", ctypes.c_int64), ("logits", ctypes.c_void_p),
                ("best", ctypes.c_void_p), ("best_logit", ctypes.c_void_p),
                ("sampling", ctypes.c_void_p)]


class _StepEmbed(ctypes.Structure):
    _fields_ = [("w", _PackedWeight), ("ids", ctypes.c_void_p)]


class _DecoderDims(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int64) for n in (
        "hidden", "num_heads", "num_kv_heads", "head_dim", "rope_dim", "neox", "intermediate",
        "block_size", "n_blocks")] + [("eps", ctypes.c_float), ("scale", ctypes.c_float)]


@dataclass(frozen=True)
class PackedLinear:
    """One packed int4 weight as `int4_mm` takes it."""
    packed: torch.Tensor  # uint8 [out_padded, planes * in / 2]
    # bf16 pairs [planes * in / gs, out_padded, 2] or [out_padded / 64, planes * in / gs, 64,
    # 2], or fp16 [in / gs, out_padded] (`scales_layout`)
    scales_zeros: torch.Tensor
    in_features: int
    out_features: int
    planes: int
    group_size: int = GROUP
    lut: torch.Tensor | None = None  # bf16 [32]: a codebook weight's `codebook_lut`

    def check(self, name: str, in_features: int, out_features: int) -> None:
        n_pad = self.packed.shape[0]
        if not (self.in_features == in_features and self.out_features == out_features
                and self.packed.dtype == torch.uint8 and self.packed.is_contiguous()
                and n_pad % TILE == 0 and out_features <= n_pad and in_features % 32 == 0
                and self.packed.shape[1] * 2 == self.planes * in_features
                and scales_layout(self.scales_zeros, self.planes * in_features, self.planes,
                                  n_pad) == (self.group_size, self.scales_form)):
            raise ValueError(f"DecoderStack: {name} is not a packed [{out_features}, "
                             f"{in_features}] weight")

    def struct(self) -> _PackedWeight:
        return _PackedWeight(self.packed.data_ptr(), self.scales_zeros.data_ptr(),
                             self.out_features, self.packed.shape[0], self.planes,
                             self.group_size, _lut_ptr(self.lut), self.scales_form)

    @property
    def scales_form(self) -> int:
        """PAIRS, TILED or HALF (`scales_layout`)"""
        return scales_form(self.scales_zeros)


@dataclass(frozen=True)
class StackLayer:
    input_norm: torch.Tensor  # bf16 [hidden]
    post_norm: torch.Tensor  # bf16 [hidden]
    qkv: PackedLinear  # [(num_heads + 2 num_kv_heads) head_dim, hidden]: q | k | v
    o: PackedLinear  # [hidden, num_heads head_dim]
    gate_up: PackedLinear  # [2 intermediate, hidden]: gate | up
    down: PackedLinear  # [hidden, intermediate]


@dataclass(frozen=True)
class StackHead:
    """An LM head `decode_layers` runs after the layers: a Q8_0 weight (two planes, fp16
    scales for groups of 32: `int8_logits`), whose `refine_k` best logits of each row are
    recomputed exactly (`int4_refine_half`) before each row's best is picked (`top_k`)."""
    weight: PackedLinear  # [vocab, hidden]
    refine_k: int


# a step through the head: fp32 logits [M, vocab], each row's best id (ties to the lower one)
# and its logit
HeadOutput = tuple[torch.Tensor, list[int], list[float]]


@dataclass(frozen=True)
class StackDims:
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_dim: int
    neox: bool
    intermediate: int
    eps: float
    scale: float


class DecoderStack:
    """The decoder layers of a model, described once for `decode_layers` (which runs them all
    for a decode step in one call). Holds references to every tensor it points at."""

    def __init__(self, layers: list[StackLayer], final_norm: torch.Tensor,
                 dims: StackDims, max_rows: int, head: StackHead | None = None,
                 embed: PackedLinear | None = None) -> None:
        # max_rows: the most sequences one call takes; embed: a weight with fp16 scales
        # (`int4_rows_half`) whose rows are the step's inputs (`run_tokens`)
        self.max_rows = max_rows
        d = dims
        if (not layers or d.num_heads % d.num_kv_heads
                or not decode_attention_supported(d.num_heads, d.num_kv_heads, d.head_dim)
                or d.rope_dim % 2 or d.rope_dim > d.head_dim):
            raise ValueError("DecoderStack: unsupported dimensions")
        for i, layer in enumerate(layers):
            for norm in (layer.input_norm, layer.post_norm):
                if norm.dtype != torch.bfloat16 or norm.shape != (d.hidden,) \
                        or not norm.is_contiguous():
                    raise ValueError(f"DecoderStack: layer {i}: bad norm weight")
            layer.qkv.check(f"layer {i} qkv", d.hidden,
                            (d.num_heads + 2 * d.num_kv_heads) * d.head_dim)
            layer.o.check(f"layer {i} o", d.num_heads * d.head_dim, d.hidden)
            layer.gate_up.check(f"layer {i} gate_up", d.hidden, 2 * d.intermediate)
            layer.down.check(f"layer {i} down", d.intermediate, d.hidden)
        if final_norm.dtype != torch.bfloat16 or final_norm.shape != (d.hidden,) \
                or not final_norm.is_contiguous():
            raise ValueError("DecoderStack: bad final norm weight")
        if head is not None:
            w = head.weight
            w.check("head", d.hidden, w.out_features)
            if not (w.planes == 2 and w.group_size == 32 and w.scales_form == HALF
                    and w.lut is None and d.hidden % 16 == 0 and d.hidden <= 16384
                    and max_rows <= REFINE_MAX and 0 < head.refine_k <= min(REFINE_MAX,
                                                                           w.out_features)):
                raise ValueError("DecoderStack: the head is not a Q8_0 weight int8_logits takes")
        if embed is not None:
            embed.check("embedding", d.hidden, embed.out_features)
            if not (embed.planes in (1, 2) and embed.scales_form == HALF and embed.lut is None
                    and d.hidden <= 16384):
                raise ValueError("DecoderStack: the embedding has no fp16 scales")
            self._embed = _StepEmbed(embed.struct(), None)
        self.layers, self.final_norm, self.dims, self.head = layers, final_norm, dims, head
        self.embed = embed
        self._x = torch.empty(max_rows, d.hidden, dtype=torch.bfloat16)  # run_tokens' inputs
        if head is not None:  # the head's struct and its best ids / logits, filled per call
            self._head = _StepHead(head.weight.struct(), head.refine_k, None, None, None, None)
            self._best, self._best_logit = (ctypes.c_int64 * 0)(), (ctypes.c_float * 0)()
            self._best_room(max_rows)
        self._structs = (_DecoderLayer * len(layers))(*[
            _DecoderLayer(l.input_norm.data_ptr(), l.post_norm.data_ptr(), l.qkv.struct(),
                          l.o.struct(), l.gate_up.struct(), l.down.struct(), None, None)
            for l in layers])
        self._pools: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._pool_key: tuple[int, ...] = ()
        self._dims = _DecoderDims(d.hidden, d.num_heads, d.num_kv_heads, d.head_dim, d.rope_dim,
                                  int(d.neox), d.intermediate, 0, 0, d.eps, d.scale)

    def _best_room(self, n: int) -> None:
        # the head's best ids and logits: room for n of each (kept for later calls)
        if n <= len(self._best):
            return
        self._best = (ctypes.c_int64 * n)()
        self._best_logit = (ctypes.c_float * n)()
        self._head.best = ctypes.addressof(self._best)
        self._head.best_logit = ctypes.addressof(self._best_logit)

    def _set_pools(self, pools: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if pools is self._pools:  # the caller's list of the last call (its tensors held here)
            return
        key = tuple(t.data_ptr() for kv in pools for t in kv)
        if key == self._pool_key:
            return
        d = self.dims
        if len(pools) != len(self.layers):
            raise ValueError("DecoderStack: one K/V pool pair per layer expected")
        shape = pools[0][0].shape
        for k, v in pools:
            if not (k.shape == v.shape == shape and len(shape) == 4
                    and shape[2:] == (d.num_kv_heads, d.head_dim)
                    and k.dtype == v.dtype == torch.bfloat16
                    and k.is_contiguous() and v.is_contiguous()):
                raise ValueError("DecoderStack: bad K/V pools")
        for s, (k, v) in zip(self._structs, pools):
            s.k_pool, s.v_pool = k.data_ptr(), v.data_ptr()
        self._dims.n_blocks, self._dims.block_size = shape[0], shape[1]
        self._pools, self._pool_key = pools, key

    def run(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
            block_tables: torch.Tensor, context_lens: torch.Tensor,
            pools: list[tuple[torch.Tensor, torch.Tensor]], cos: torch.Tensor,
            sin: torch.Tensor) -> torch.Tensor:
        """x: bf16 [M, hidden] embeddings of M sequences' next tokens -> final normalized
        hidden states [M, hidden] (x itself, overwritten). positions, slots, context_lens:
        int64 [M]; block_tables: int64 [M, width]; cos, sin: fp32 [rows, rope_dim / 2];
        pools: each layer's (K, V) pool, the list of the last call taken as unchanged."""
        self._call(x, None, positions, slots, block_tables, context_lens, pools, cos, sin, None,
                   None)
        return x

    def run_logits(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                   block_tables: torch.Tensor, context_lens: torch.Tensor,
                   pools: list[tuple[torch.Tensor, torch.Tensor]], cos: torch.Tensor,
                   sin: torch.Tensor) -> HeadOutput:
        """`run`, then the head (built with one) on its output, in the same call."""
        return self._logits(x, None, positions, slots, block_tables, context_lens, pools, cos,
                            sin)

    def run_tokens(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                   block_tables: torch.Tensor, context_lens: torch.Tensor,
                   pools: list[tuple[torch.Tensor, torch.Tensor]], cos: torch.Tensor,
                   sin: torch.Tensor, head: bool) -> torch.Tensor | HeadOutput:
        """`run` (or with head, `run_logits`) from the step's token ids (int64 [M]), whose
        embedding rows the same call looks up (a stack built with `embed`)."""
        assert self.embed is not None, "DecoderStack.run_tokens: no embedding"
        m = ids.shape[0]
        if not (ids.dtype == torch.int64 and ids.shape == (m,) and ids.is_contiguous()):
            raise ValueError("DecoderStack.run_tokens: bad token ids")
        self._embed.ids = ids.data_ptr()
        if head:
            return self._logits(self._x, m, positions, slots, block_tables, context_lens, pools,
                                cos, sin)
        x = torch.empty(m, self.dims.hidden, dtype=torch.bfloat16)
        self._call(x, m, positions, slots, block_tables, context_lens, pools, cos, sin,
                   self._embed, None)
        return x

    def run_steps(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                  block_tables: torch.Tensor, context_lens: torch.Tensor,
                  pools: list[tuple[torch.Tensor, torch.Tensor]], cos: torch.Tensor,
                  sin: torch.Tensor, steps: int, draws: Sequence[RowSampling] | None = None
                  ) -> tuple[list[list[int]], list[list[float]]]:
        """`steps` decode steps in one call (a stack with an embedding and a head): the first
        from ids at positions / slots / context_lens, each later one from the rows' tokens of
        the step before, one position on (slots from block_tables, which must hold them; cos
        and sin must cover the last position). A row's token is its best, or with `draws`
        (one per row) where its temperature is above 0, its draw (`sample_rows`: draw count +
        j at step j). Returns token[step][row] and the row's best logit, the tokens `steps`
        calls of `run_tokens` (each followed by `sample_rows`) would give one after another."""
        assert self.embed is not None and self.head is not None, \
            "DecoderStack.run_steps: needs the embedding and the head"
        m = ids.shape[0]
        if not (steps >= 1 and ids.dtype == torch.int64 and ids.shape == (m,)
                and ids.is_contiguous() and (draws is None or len(draws) == m)):
            raise ValueError("DecoderStack.run_steps: bad token ids, steps or draws")
        vocab = self.head.weight.out_features
        if draws is not None and any(r.temperature > 0 and r.top_k > vocab for r in draws):
            raise ValueError("DecoderStack.run_steps: a top_k beyond the vocabulary")
        sampling = None if draws is None else sampling_rows(draws)
        self._embed.ids = ids.data_ptr()
        self._best_room(steps * m)
        logits = torch.empty(m, vocab, dtype=torch.float32)
        self._head.logits = logits.data_ptr()
        self._head.sampling = None if sampling is None else ctypes.addressof(sampling)
        try:
            self._call(self._x, m, positions, slots, block_tables, context_lens, pools, cos,
                       sin, self._embed, self._head, steps)
        finally:
            self._head.sampling = None
        best, best_logit = self._best[:steps * m], self._best_logit[:steps * m]
        return ([best[j * m:(j + 1) * m] for j in range(steps)],
                [best_logit[j * m:(j + 1) * m] for j in range(steps)])

    def _logits(self, x: torch.Tensor, m: int | None, positions: torch.Tensor,
                slots: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                pools: list[tuple[torch.Tensor, torch.Tensor]], cos: torch.Tensor,
                sin: torch.Tensor) -> HeadOutput:
        # m: rows of x the call embeds itself (run_tokens); None: x holds the inputs
        assert self.head is not None, "DecoderStack: no head"
        rows = x.shape[0] if m is None else m
        logits = torch.empty(rows, self.head.weight.out_features, dtype=torch.float32)
        self._head.logits = logits.data_ptr()
        self._call(x, m, positions, slots, block_tables, context_lens, pools, cos, sin,
                   None if m is None else self._embed, self._head)
        return logits, self._best[:rows], self._best_logit[:rows]

    def _call(self, x: torch.Tensor, m: int | None, positions: torch.Tensor,
              slots: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
              pools: list[tuple[torch.Tensor, torch.Tensor]], cos: torch.Tensor,
              sin: torch.Tensor, embed: _StepEmbed | None, head: _StepHead | None,
              steps: int = 1) -> None:
        # x: bf16 [>= m, hidden], its first m rows the step's (all of them for m None)
        lib = cpu_native.library()
        assert lib is not None
        self._set_pools(pools)
        m = x.shape[0] if m is None else m
        i64 = torch.int64
        if not (x.dtype == torch.bfloat16 and x.is_contiguous() and x.dim() == 2
                and x.shape[1] == self.dims.hidden and 0 < m <= min(self.max_rows, x.shape[0])
                and positions.dtype == slots.dtype == context_lens.dtype == i64
                and block_tables.dtype == i64 and block_tables.dim() == 2
                and block_tables.shape[0] == m and block_tables.is_contiguous()
                and positions.shape == slots.shape == context_lens.shape == (m,)
                and positions.is_contiguous() and slots.is_contiguous()
                and context_lens.is_contiguous()
                and cos.dtype == sin.dtype == torch.float32 and cos.shape == sin.shape
                and cos.is_contiguous() and sin.is_contiguous()
                and cos.shape[1] == self.dims.rope_dim // 2):
            raise ValueError("DecoderStack.run: bad operands")
        rc = lib.decode_layers(self._structs, len(self.layers), ctypes.byref(self._dims),
                               self.final_norm.data_ptr(), x.data_ptr(), m,
                               positions.data_ptr(), slots.data_ptr(), block_tables.data_ptr(),
                               block_tables.shape[1], context_lens.data_ptr(), cos.data_ptr(),
                               sin.data_ptr(), cos.shape[0],
                               None if embed is None else ctypes.byref(embed),
                               None if head is None else ctypes.byref(head), steps)
        if rc == -2:
            raise MemoryError("decode_layers: out of memory")
        if rc == -3:
            raise IndexError("decode_layers: a token id is beyond the embedding")
        if rc:
            raise ValueError("decode_layers: a position, slot, block or context length is out "
                             "of range")

    def run_ref(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                block_tables: torch.Tensor, context_lens: torch.Tensor,
                pools: list[tuple[torch.Tensor, torch.Tensor]], cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        """Plain-PyTorch reference of `run` (returns a new tensor)."""
        d, m = self.dims, x.shape[0]
        head_dim = d.head_dim
        q_end = d.num_heads * head_dim  # q | k | v along each row of the fused projection
        k_end = (d.num_heads + d.num_kv_heads) * head_dim

        def mm(w: PackedLinear, a: torch.Tensor) -> torch.Tensor:
            return int4_mm_ref(a, w.packed, w.scales_zeros, w.out_features, w.planes, w.lut)

        res = x.clone()
        y = x
        for i, (layer, (kp, vp)) in enumerate(zip(self.layers, pools)):
            h = (rms_norm_ref(res, layer.input_norm, d.eps) if i == 0
                 else rms_norm_ref(y, layer.input_norm, d.eps, res))
            qkv = rope_ref(mm(layer.qkv, h), d.num_heads + d.num_kv_heads, head_dim, d.rope_dim,
                           cos, sin, positions, d.neox)
            kv_store_ref(qkv[:, q_end:k_end], qkv[:, k_end:], slots, kp, vp)
            att = decode_attention_ref(qkv[:, :q_end].reshape(m, d.num_heads, head_dim), kp, vp,
                                       block_tables, context_lens, d.scale)
            h = rms_norm_ref(mm(layer.o, att.reshape(m, q_end)), layer.post_norm, d.eps, res)
            y = mm(layer.down, silu_mul_ref(mm(layer.gate_up, h)))
        return rms_norm_ref(y, self.final_norm, d.eps, res)

    def run_logits_ref(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                       block_tables: torch.Tensor, context_lens: torch.Tensor,
                       pools: list[tuple[torch.Tensor, torch.Tensor]], cos: torch.Tensor,
                       sin: torch.Tensor) -> HeadOutput:
        """Plain-PyTorch reference of `run_logits`."""
        assert self.head is not None
        h = self.run_ref(x, positions, slots, block_tables, context_lens, pools, cos, sin)
        w = self.head.weight
        logits = int8_logits_ref(h, w.packed, w.scales_zeros, w.out_features)
        int4_refine_half_ref(logits, h, w.packed, w.scales_zeros, 2, self.head.refine_k)
        best = top_k_ref(logits, 1)[:, 0]
        return logits, best.tolist(), logits.gather(1, best[:, None])[:, 0].tolist()
