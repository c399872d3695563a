"""The small fused ops of the Triton backend, each beside its plain-PyTorch reference: RMSNorm
(optionally adding into the residual stream first), RoPE in place, SiLU-and-mul. The K/V store
lives in `triton_kv_store` and is re-exported here.

Every op reads rows of unit column stride (any row stride), does its math in fp32 and rounds
once to the activation dtype when it stores. One program handles one row (a column block of
one row for `silu_mul`, a block of heads of one row for `rope_`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from localllm.kernels.triton_common import EMULATE_BF16, cast
from localllm.kernels.triton_kv_store import kv_store, kv_store_ref

__all__ = ["add_rms_norm", "add_rms_norm_ref", "kv_store", "kv_store_ref", "rms_norm",
           "rms_norm_ref", "rope_", "rope_ref", "silu_mul", "silu_mul_ref"]

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
SILU_BLOCK = 1024  # columns of one silu_mul program
ROPE_TILE = 4096  # heads x pairs of one rope_ program


def _warps(elements: int) -> int:
    return 4 if elements <= 2048 else 8 if elements <= 8192 else 16


def _check_rows(op: str, name: str, t: torch.Tensor, shape: tuple[int, ...] | None = None,
                dtype: torch.dtype | None = None) -> None:
    """Raises ValueError unless t is a 2-D float tensor of unit column stride (and `shape`,
    `dtype` where given)."""
    if t.dim() != 2 or t.dtype not in FLOATS or (t.shape[1] > 1 and t.stride(1) != 1):
        raise ValueError(f"{op}: {name} must be a 2-D float16/bfloat16/float32 tensor with unit "
                         f"column stride, got {tuple(t.shape)} {t.dtype} strides {t.stride()}")
    if shape is not None and tuple(t.shape) != shape:
        raise ValueError(f"{op}: {name} has shape {tuple(t.shape)}, expected {shape}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{op}: {name} is {t.dtype}, expected {dtype}")


def _check_device(op: str, *ts: torch.Tensor) -> None:
    if any(t.device != ts[0].device for t in ts):
        raise ValueError(f"{op}: tensors on several devices: {[str(t.device) for t in ts]}")


@triton.jit
def _rms_norm_kernel(x_ptr, x_stride, r_ptr, r_stride, w_ptr, out_ptr, out_stride, D, eps,
                     ADD: tl.constexpr, BLOCK_D: tl.constexpr, EMULATE_BF16: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if ADD:
        r_ptrs = r_ptr + row * r_stride + cols
        r = tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32)
        s = cast(x + r, r_ptr.dtype.element_ty, EMULATE_BF16)
        tl.store(r_ptrs, s, mask=mask)
        x = s.to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = cast(x * inv * w, out_ptr.dtype.element_ty, EMULATE_BF16)
    tl.store(out_ptr + row * out_stride + cols, y, mask=mask)


def _norm(op: str, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
          eps: float, out: torch.Tensor | None) -> torch.Tensor:
    _check_rows(op, "x", x)
    t, d = x.shape
    if residual is not None:
        _check_rows(op, "residual", residual, (t, d), x.dtype)
    if weight.shape != (d,) or weight.dtype not in FLOATS or (d > 1 and weight.stride(0) != 1):
        raise ValueError(f"{op}: weight must be a contiguous float [{d}] tensor, got "
                         f"{tuple(weight.shape)} {weight.dtype}")
    if out is None:
        out = torch.empty(t, d, dtype=x.dtype, device=x.device)
    _check_rows(op, "out", out, (t, d), x.dtype)
    _check_device(op, x, weight, out, *(() if residual is None else (residual,)))
    if t > 0 and d > 0:
        block = triton.next_power_of_2(d)
        r = x if residual is None else residual
        _rms_norm_kernel[(t,)](x, x.stride(0), r, r.stride(0), weight, out, out.stride(0), d,
                               float(eps), ADD=residual is not None, BLOCK_D=block,
                               EMULATE_BF16=EMULATE_BF16, num_warps=_warps(block))
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, D] (unit column stride), weight [D] -> x * rsqrt(mean(x^2) + eps) * weight in
    fp32, rounded once to x.dtype; written to `out` ([T, D] of x.dtype) when given."""
    return _norm("rms_norm", x, None, weight, eps, out)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return y.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x in place (fp32 add, rounded to residual.dtype; both [T, D] of one dtype),
    then (rms_norm(residual, weight, eps), residual), in one pass over each row."""
    return _norm("add_rms_norm", x, residual, weight, eps, out), residual


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    residual.copy_((x.float() + residual.float()).to(residual.dtype))
    return rms_norm_ref(residual, weight, eps), residual


@triton.jit
def _silu_mul_kernel(gu_ptr, gu_stride, out_ptr, out_stride, I, BLOCK: tl.constexpr,
                     EMULATE_BF16: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    g = tl.load(gu_ptr + row * gu_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * gu_stride + I + cols, mask=mask, other=0.0).to(tl.float32)
    y = cast(g * tl.sigmoid(g) * u, out_ptr.dtype.element_ty, EMULATE_BF16)
    tl.store(out_ptr + row * out_stride + cols, y, mask=mask)


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """gate_up [T, 2I] (gate | up, unit column stride) -> silu(gate) * up [T, I] in fp32,
    rounded once to gate_up.dtype; written to `out` ([T, I] of that dtype) when given."""
    _check_rows("silu_mul", "gate_up", gate_up)
    t, n = gate_up.shape
    if n % 2:
        raise ValueError(f"silu_mul: gate_up has an odd number of columns ({n})")
    i = n // 2
    if out is None:
        out = torch.empty(t, i, dtype=gate_up.dtype, device=gate_up.device)
    _check_rows("silu_mul", "out", out, (t, i), gate_up.dtype)
    _check_device("silu_mul", gate_up, out)
    if t > 0 and i > 0:
        block = min(triton.next_power_of_2(i), SILU_BLOCK)
        _silu_mul_kernel[(t, triton.cdiv(i, block))](
            gate_up, gate_up.stride(0), out, out.stride(0), i, BLOCK=block,
            EMULATE_BF16=EMULATE_BF16, num_warps=_warps(block))
    return out


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(gate_up.dtype)


@triton.jit
def _rope_kernel(x_ptr, x_stride, cos_ptr, sin_ptr, pos_ptr, num_pos, heads, head_dim, half,
                 NEOX: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
                 EMULATE_BF16: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    hs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK_R)
    pos = tl.load(pos_ptr + row).to(tl.int64) + tl.zeros([BLOCK_R], dtype=tl.int64)
    # NOTE: a position outside the tables leaves the row as it is (checked on CPU hosts only)
    ci = (i < half) & (pos >= 0) & (pos < num_pos)
    c = tl.load(cos_ptr + pos * half + i, mask=ci, other=1.0)[None, :]
    s = tl.load(sin_ptr + pos * half + i, mask=ci, other=0.0)[None, :]
    if NEOX:
        d1 = i
        d2 = i + half
    else:
        d1 = 2 * i
        d2 = 2 * i + 1
    base = x_ptr + row * x_stride + hs[:, None] * head_dim  # [BLOCK_H, 1]
    mask = (hs[:, None] < heads) & ci[None, :]
    x1 = tl.load(base + d1[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + d2[None, :], mask=mask, other=0.0).to(tl.float32)
    ty = x_ptr.dtype.element_ty
    tl.store(base + d1[None, :], cast(x1 * c - x2 * s, ty, EMULATE_BF16), mask=mask)
    tl.store(base + d2[None, :], cast(x2 * c + x1 * s, ty, EMULATE_BF16), mask=mask)


def rope_(x: torch.Tensor, heads: int, head_dim: int, rope_dim: int, cos: torch.Tensor,
          sin: torch.Tensor, positions: torch.Tensor, neox: bool) -> torch.Tensor:
    """Rotates in place the first `heads` heads (side by side, `head_dim` each) of every row of
    x [T, >= heads * head_dim] (unit column stride, any row stride) and returns x.

    cos, sin: fp32 [num_positions, rope_dim / 2], contiguous; positions: int64 (or int32) [T].
    neox=False rotates dims (2i, 2i+1) of each head by angle i, neox=True dims (i, i +
    rope_dim / 2); dims >= rope_dim pass through. fp32 math, stored in x.dtype. A position
    outside the tables is a ValueError when positions is on the CPU; on a GPU it is not
    checked (that would cost a device sync per call) and its row is left unrotated."""
    _check_rows("rope_", "x", x)
    t = x.shape[0]
    if not (heads >= 0 and 0 <= rope_dim <= head_dim and rope_dim % 2 == 0
            and x.shape[1] >= heads * head_dim):
        raise ValueError(f"rope_: {heads} heads of {head_dim} (rope_dim {rope_dim}, even and "
                         f"<= head_dim) do not fit rows of {x.shape[1]}")
    half = rope_dim // 2
    for name, tab in (("cos", cos), ("sin", sin)):
        if tab.dtype != torch.float32 or tab.dim() != 2 or tab.shape[1] != half \
                or not tab.is_contiguous():
            raise ValueError(f"rope_: {name} must be contiguous fp32 [num_positions, {half}], "
                             f"got {tuple(tab.shape)} {tab.dtype}")
    if cos.shape != sin.shape:
        raise ValueError(f"rope_: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} differ")
    if positions.dtype not in (torch.int64, torch.int32) or positions.shape != (t,) \
            or not positions.is_contiguous():
        raise ValueError(f"rope_: positions must be contiguous int64 [{t}], got "
                         f"{tuple(positions.shape)} {positions.dtype}")
    _check_device("rope_", x, cos, sin, positions)
    num_pos = cos.shape[0]
    if positions.device.type == "cpu" and t > 0 and (
            int(positions.min()) < 0 or int(positions.max()) >= num_pos):
        raise ValueError(f"rope_: a position is outside the cos/sin tables [0, {num_pos})")
    if t > 0 and heads > 0 and half > 0:
        block_r = triton.next_power_of_2(half)
        block_h = min(triton.next_power_of_2(heads), max(1, ROPE_TILE // block_r))
        grid = (t, triton.cdiv(heads, block_h))
        _rope_kernel[grid](x, x.stride(0), cos, sin, positions, num_pos, heads, head_dim, half,
                           NEOX=bool(neox), BLOCK_H=block_h, BLOCK_R=block_r,
                           EMULATE_BF16=EMULATE_BF16,
                           num_warps=_warps(block_h * block_r))
    return x


def rope_ref(x: torch.Tensor, heads: int, head_dim: int, rope_dim: int, cos: torch.Tensor,
             sin: torch.Tensor, positions: torch.Tensor, neox: bool) -> torch.Tensor:
    half = rope_dim // 2
    h = x[:, :heads * head_dim].unflatten(1, (heads, head_dim))  # [T, heads, head_dim]
    r = h[..., :rope_dim].float()
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)  # [T, 1, half]
    if neox:
        x1, x2 = r[..., :half], r[..., half:]
        rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    else:
        x1, x2 = r[..., 0::2], r[..., 1::2]
        rotated = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    h[..., :rope_dim] = rotated.to(x.dtype)
    return x
