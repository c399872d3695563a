"""The K/V store of the paged cache in Triton, beside its plain-PyTorch reference: each new
token's K and V rows go to the pool slot that `slot_mapping` gives it."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from localllm.kernels.triton_common import EMULATE_BF16, cast

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
TILE = 4096  # heads x head_dim of one program


@triton.jit
def _kv_store_kernel(k_ptr, k_stride_t, k_stride_h, v_ptr, v_stride_t, v_stride_h, slot_ptr,
                     kp_ptr, vp_ptr, n_slots, KVH, D, BLOCK_H: tl.constexpr,
                     BLOCK_D: tl.constexpr, EMULATE_BF16: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    hs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ds = tl.arange(0, BLOCK_D)
    slot = tl.load(slot_ptr + row).to(tl.int64) + tl.zeros([BLOCK_D], dtype=tl.int64)
    # NOTE: slot -1 (a padding token) and any slot outside the pool are skipped
    ok = (ds < D) & (slot >= 0) & (slot < n_slots)
    mask = (hs[:, None] < KVH) & ok[None, :]
    dst = slot[None, :] * KVH * D + hs[:, None] * D + ds[None, :]  # [BLOCK_H, BLOCK_D]
    k = tl.load(k_ptr + row * k_stride_t + hs[:, None] * k_stride_h + ds[None, :], mask=mask)
    tl.store(kp_ptr + dst, cast(k, kp_ptr.dtype.element_ty, EMULATE_BF16), mask=mask)
    v = tl.load(v_ptr + row * v_stride_t + hs[:, None] * v_stride_h + ds[None, :], mask=mask)
    tl.store(vp_ptr + dst, cast(v, vp_ptr.dtype.element_ty, EMULATE_BF16), mask=mask)


def _check(k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, k_pool: torch.Tensor,
           v_pool: torch.Tensor) -> None:
    for name, x in (("k", k), ("v", v)):
        if x.dim() != 3 or x.dtype not in FLOATS or (x.shape[2] > 1 and x.stride(2) != 1):
            raise ValueError(f"kv_store: {name} must be a float [T, num_kv_heads, head_dim] "
                             f"tensor with unit stride on head_dim, got {tuple(x.shape)} "
                             f"{x.dtype} strides {x.stride()}")
    if v.shape != k.shape:
        raise ValueError(f"kv_store: k {tuple(k.shape)} and v {tuple(v.shape)} differ")
    t, kvh, d = k.shape
    for name, p in (("k_pool", k_pool), ("v_pool", v_pool)):
        if p.dim() != 4 or tuple(p.shape[2:]) != (kvh, d) or p.dtype not in FLOATS \
                or not p.is_contiguous():
            raise ValueError(f"kv_store: {name} must be a contiguous float [num_blocks, "
                             f"block_size, {kvh}, {d}] tensor, got {tuple(p.shape)} {p.dtype}")
    if v_pool.shape != k_pool.shape or v_pool.dtype != k_pool.dtype:
        raise ValueError(f"kv_store: k_pool {tuple(k_pool.shape)} {k_pool.dtype} and v_pool "
                         f"{tuple(v_pool.shape)} {v_pool.dtype} differ")
    if slot_mapping.dtype not in (torch.int32, torch.int64) or slot_mapping.shape != (t,) \
            or not slot_mapping.is_contiguous():
        raise ValueError(f"kv_store: slot_mapping must be contiguous int32/int64 [{t}], got "
                         f"{tuple(slot_mapping.shape)} {slot_mapping.dtype}")
    devices = {x.device for x in (k, v, slot_mapping, k_pool, v_pool)}
    if len(devices) > 1:
        raise ValueError(f"kv_store: tensors on several devices: {sorted(map(str, devices))}")


def kv_store(k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, k_pool: torch.Tensor,
             v_pool: torch.Tensor) -> None:
    """Writes k[t] and v[t] ([T, num_kv_heads, head_dim], unit stride on head_dim, any other
    strides: views into a fused qkv output are fine) to flat slot slot_mapping[t] (int32/int64
    [T]; slot = block * block_size + offset) of k_pool and v_pool ([num_blocks, block_size,
    num_kv_heads, head_dim], contiguous, one float dtype), converted to the pool dtype.

    Slot -1 skips its token (the padding of a captured CUDA graph batch). Other slots outside
    [0, num_blocks * block_size) are a ValueError when slot_mapping is on the CPU; on a GPU they
    are not checked (that would cost a device sync per call) and their tokens are skipped."""
    _check(k, v, slot_mapping, k_pool, v_pool)
    t, kvh, d = k.shape
    n_slots = k_pool.shape[0] * k_pool.shape[1]
    if slot_mapping.device.type == "cpu" and t > 0 and (
            int(slot_mapping.min()) < -1 or int(slot_mapping.max()) >= n_slots):
        raise ValueError(f"kv_store: a slot is outside the pool [-1, {n_slots})")
    if t == 0 or kvh == 0 or d == 0:
        return
    block_d = triton.next_power_of_2(d)
    block_h = min(triton.next_power_of_2(kvh), max(1, TILE // block_d))
    _kv_store_kernel[(t, triton.cdiv(kvh, block_h))](
        k, k.stride(0), k.stride(1), v, v.stride(0), v.stride(1), slot_mapping, k_pool, v_pool,
        n_slots, kvh, d, BLOCK_H=block_h, BLOCK_D=block_d, EMULATE_BF16=EMULATE_BF16,
        num_warps=4 if block_h * block_d <= 2048 else 8)


def kv_store_ref(k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
                 k_pool: torch.Tensor, v_pool: torch.Tensor) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    _, _, kvh, d = k_pool.shape
    k_pool.view(-1, kvh, d)[slots] = k[keep].to(k_pool.dtype)
    v_pool.view(-1, kvh, d)[slots] = v[keep].to(v_pool.dtype)
