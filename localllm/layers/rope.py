"""Rotary position embeddings: default, linear, Llama-3, YaRN and LongRoPE frequency scaling.

Two layouts:
- pairs (GGUF `llama`, `rope_neox=False`): dims (2i, 2i+1) rotate together by angle p*f_i.
- halves (NEOX / Hugging Face, `rope_neox=True`): dims (i, i + rope_dim/2) rotate together.
Only the first `rope_dim` dims of each head rotate; the rest pass through.

The tables and the PyTorch rotation live here; `rotate_heads_` lets the backend rotate q and k
of a fused projection in place with its own kernel where it has one.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from localllm.config import ModelConfig, RopeScaling
from localllm.errors import ModelLoadError
from localllm.layers.ops import LayerOps


def rope_inv_freq(cfg: ModelConfig, freq_factors: torch.Tensor | None = None,
                  local: bool = False) -> torch.Tensor:
    """Per-pair inverse frequencies [rope_dim/2] in fp32, scaling applied; `local`: those of
    the sliding-window layers of a model with their own base (`rope_theta_local`, unscaled).

    Always computed on the CPU (a few numbers): even inside `torch.device("meta")`, where the
    loader builds a model to read its shapes and meta math would import PyTorch's Python
    decompositions (about 75 MB resident)."""
    dim = cfg.rope_dim
    cpu = torch.device("cpu")
    theta = cfg.rope_theta_local if local else cfg.rope_theta
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=cpu) / dim))
    sc = RopeScaling() if local else cfg.rope_scaling
    if sc.kind == "linear":
        inv = inv / sc.factor
    elif sc.kind == "llama3":
        orig = sc.original_context or cfg.context_length
        low_wl = orig / sc.low_freq_factor
        high_wl = orig / sc.high_freq_factor
        wl = 2 * math.pi / inv
        smooth = (orig / wl - sc.low_freq_factor) / (sc.high_freq_factor - sc.low_freq_factor)
        scaled = torch.where(wl > low_wl, inv / sc.factor, inv)
        mid = (wl <= low_wl) & (wl >= high_wl)
        inv = torch.where(mid, (1 - smooth) * inv / sc.factor + smooth * inv, scaled)
    elif sc.kind == "yarn":
        orig = sc.original_context or cfg.context_length
        # NTK-by-parts: a ramp between the dims turning beta_fast and beta_slow times over
        # the original context; below it frequencies stay, above it they are divided

        def corr_dim(rot: float) -> float:
            return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(theta))
        low, high = corr_dim(sc.beta_fast), corr_dim(sc.beta_slow)
        if sc.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        ramp = (torch.arange(dim // 2, dtype=torch.float64, device=cpu) - low) / (
            high - low if high != low else 1e-3)
        extrap = 1 - ramp.clamp(0, 1)
        inv = inv / sc.factor * (1 - extrap) + inv * extrap
    elif sc.kind == "longrope" and sc.long_factors:
        long = cfg.context_length > sc.original_context
        factors = sc.long_factors if long else sc.short_factors
        if len(factors) != dim // 2:
            raise ModelLoadError(f"LongRoPE: {len(factors)} factors for {dim // 2} "
                                 f"frequencies")
        inv = inv / torch.tensor(factors, dtype=torch.float64, device=cpu)
    if freq_factors is not None:  # GGUF `rope_freqs.weight` (Llama 3) or LongRoPE factors
        inv = inv / freq_factors.to(torch.float64)
    return inv.float()


def attention_factor(cfg: ModelConfig, local: bool = False) -> float:
    """The factor on cos and sin (YaRN's and LongRoPE's magnitude correction)."""
    sc = cfg.rope_scaling
    if local or sc.kind not in ("yarn", "longrope"):
        return 1.0
    if sc.attention_factor:
        return sc.attention_factor
    if sc.factor <= 1:
        return 1.0
    if sc.kind == "yarn":
        return 0.1 * math.log(sc.factor) + 1.0
    return math.sqrt(1 + math.log(sc.factor) / math.log(sc.original_context))


class RotaryEmbedding(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: LayerOps, local: bool = False) -> None:
        super().__init__()
        self.backend = backend
        self.rope_dim = cfg.rope_dim
        self.neox = cfg.rope_neox
        self.local = local
        self.mscale = attention_factor(cfg, local)
        self.max_positions = cfg.context_length
        self.register_buffer("inv_freq", rope_inv_freq(cfg, local=local), persistent=False)
        self._cos = torch.empty(0, device="cpu")
        self._sin = torch.empty(0, device="cpu")
        self._rot = torch.empty(0, dtype=torch.complex64, device="cpu")
        self._last_positions: torch.Tensor | None = None
        self._tables_positions: torch.Tensor | None = None
        self._last: tuple[torch.Tensor, torch.Tensor, torch.Tensor] = (self._rot,) * 3

    def set_freq_factors(self, factors: torch.Tensor, cfg: ModelConfig) -> None:
        """Divides the frequencies by a file's factors [rope_dim/2] (global layers only)."""
        if self.local:
            return
        self.inv_freq = rope_inv_freq(cfg, factors)
        self._cos = torch.empty(0)
        self._last_positions = self._tables_positions = None

    def tables(self, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cos.shape[0] < n or self._cos.device != device:
            # doubling as contexts grow (2 MB of tables for 4096 positions at head_dim 64)
            size = max(n, min(self.max_positions, max(256, 1 << (n - 1).bit_length())))
            pos = torch.arange(size, dtype=torch.float32, device=device)
            freqs = torch.outer(pos, self.inv_freq.to(device))  # [positions, rope_dim/2]
            self._cos = freqs.cos() * self.mscale
            self._sin = freqs.sin() * self.mscale
            self._rot = torch.complex(self._cos, self._sin)  # e^(i p f), scaled
            self._last_positions = self._tables_positions = None
        return self._cos, self._sin

    def _at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(rot, cos, sin) at `positions`, [T, 1, rope_dim/2] each (only rot for the pairs
        layout, only cos and sin for halves). Every layer of a step passes the same positions
        tensor, so the lookup is done once per step and reused."""
        if positions is not self._last_positions:
            cos_t, sin_t = self._step_tables(positions)
            self._last_positions = positions
            if self.neox:
                self._last = (self._rot, cos_t[positions].unsqueeze(1),
                              sin_t[positions].unsqueeze(1))
            else:
                self._last = (self._rot[positions].unsqueeze(1), cos_t, sin_t)
        return self._last

    def rotate_heads_(self, positions: torch.Tensor, x: torch.Tensor, heads: int,
                      head_dim: int) -> bool:
        """Rotates the first `heads` heads of each row of x ([T, >= heads * head_dim], heads
        side by side) in place with the backend's kernel, and says whether it did; False
        leaves x untouched (the backend has none for this dtype or device)."""
        cos_t, sin_t = self._step_tables(positions)  # positions past them fail in the kernel
        return self.backend.rope_(x, heads, head_dim, self.rope_dim, cos_t, sin_t, positions,
                                  self.neox)

    def pin_tables(self, positions: torch.Tensor) -> None:
        """Builds the tables for the whole context and takes them as covering `positions` from
        now on: a static buffer whose values change between replays of a captured CUDA graph
        (its maximum is then never read back from the device)."""
        self.tables(self.max_positions, positions.device)
        self._tables_positions = positions

    def _step_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`tables` reaching the step's last position; every layer of a step passes the same
        positions tensor, so its maximum is taken once per step."""
        if positions is not self._tables_positions:
            self.tables(int(positions.max()) + 1, positions.device)
            self._tables_positions = positions
        return self._cos, self._sin

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # positions: [T]; x: [T, heads, head_dim] (any heads: q, k, or both stacked)
        rot, cos, sin = self._at(positions)
        if not self.neox:
            return self._rotate_pairs(x, rot)
        return self._rotate_halves(x, cos, sin)

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T]; q: [T, n_heads, head_dim]; k: [T, n_kv_heads, head_dim]
        return self.rotate(positions, q), self.rotate(positions, k)

    def _rotate_pairs(self, x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
        # adjacent pairs as complex numbers: (x1 + i x2) * (cos + i sin)
        d = self.rope_dim
        xr = x[..., :d].float().reshape(*x.shape[:-1], d // 2, 2)
        out = torch.view_as_real(torch.view_as_complex(xr) * rot).flatten(-2).to(x.dtype)
        return out if d == x.shape[-1] else torch.cat((out, x[..., d:]), dim=-1)

    def _rotate_halves(self, x: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor) -> torch.Tensor:
        d = self.rope_dim
        xr = x[..., :d].float()
        x1, x2 = xr[..., : d // 2], xr[..., d // 2:]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
        return out if d == x.shape[-1] else torch.cat((out, x[..., d:]), dim=-1)
