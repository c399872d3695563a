"""The CPU backend moves a loaded model's packed weights into one map on 2 MiB pages
(`weight_arena`): every weight lands there, in module order, unchanged, and the model computes
the same tokens as with the weights where loading put them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from localllm import LLM, CacheConfig, SamplingParams
from localllm.backends.cpu import weight_arena
from localllm.backends.cpu.weights import CpuPackedWeight


def _load(path: Path, monkeypatch: pytest.MonkeyPatch, huge: bool) -> LLM:
    monkeypatch.setenv("LOCALLLM_HUGE_PAGES", "1" if huge else "0")
    return LLM(path, dtype="bfloat16", cache=CacheConfig(prefix_cache=False))


def _packed(llm: LLM) -> list[CpuPackedWeight]:
    ws = weight_arena.packed_weights(llm.engine.runner.model)
    assert ws, "the default model in bf16 has packed weights"
    return ws


def _mapping(addr: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds `addr`."""
    fields: dict[str, str] = {}
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(v, 16) for v in head.split("-"))
                if inside:
                    break
                inside = lo <= addr < hi
            elif inside:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
    return fields


def _consecutive(ws: list[CpuPackedWeight]) -> list[bool]:
    """For each tensor after the first: whether it starts where its predecessor's bytes,
    rounded up to a cache line, end."""
    tensors = [t for w in ws for t in (w.packed, w.scales_zeros)]
    return [b.data_ptr() - a.data_ptr() == -(-a.numel() * a.element_size() // 64) * 64
            for a, b in zip(tensors, tensors[1:])]


def test_packed_weights_lie_in_one_map_in_module_order(
        smollm_path: Path, monkeypatch: pytest.MonkeyPatch, one_torch_thread: None) -> None:
    llm = _load(smollm_path, monkeypatch, huge=True)
    ws = _packed(llm)
    if not weight_arena.enabled():  # this kernel has no huge pages for such a map
        assert weight_arena.huge_pages_setting() not in ("always", "madvise")
        assert not all(_consecutive(ws))
        return
    ptrs = [t.data_ptr() for w in ws for t in (w.packed, w.scales_zeros)]
    assert ptrs[0] % weight_arena.PAGE == 0
    assert all(_consecutive(ws))
    maps = {_mapping(p).get("THPeligible") for p in (ptrs[0], ptrs[-1])}
    assert maps == {"1"}, "the weights' map may take 2 MiB pages"


def test_gather_moves_weights_into_one_map_unchanged(
        smollm_path: Path, monkeypatch: pytest.MonkeyPatch, one_torch_thread: None) -> None:
    # whatever this kernel's huge page mode: gather itself, on weights loading left in place
    ws = _packed(_load(smollm_path, monkeypatch, huge=False))[:12]
    before = [(w.packed.clone(), w.scales_zeros.clone()) for w in ws]
    got = weight_arena.gather(ws)
    sizes = [t.numel() * t.element_size() for p in before for t in p]
    assert (got.tensors, got.nbytes) == (2 * len(ws), sum(sizes))
    assert ws[0].packed.data_ptr() % weight_arena.PAGE == 0
    assert all(_consecutive(ws))
    for w, (packed, scales) in zip(ws, before):
        assert torch.equal(w.packed, packed) and torch.equal(w.scales_zeros, scales)
        assert w.packed.is_contiguous() and w.scales_zeros.is_contiguous()


def test_moved_weights_hold_the_same_values_and_give_the_same_tokens(
        smollm_path: Path, monkeypatch: pytest.MonkeyPatch, one_torch_thread: None) -> None:
    moved = _load(smollm_path, monkeypatch, huge=True)
    kept = _load(smollm_path, monkeypatch, huge=False)
    a, b = _packed(moved), _packed(kept)
    assert len(a) == len(b)
    for wa, wb in zip(a, b):
        assert torch.equal(wa.packed, wb.packed)
        assert torch.equal(wa.scales_zeros, wb.scales_zeros)
    assert not all(_consecutive(b)), "LOCALLLM_HUGE_PAGES=0 leaves the weights where they were"
    prompt = moved.encode("The little robot learned to")
    sp = SamplingParams(max_tokens=12, temperature=0)
    assert (moved.generate([prompt], sp)[0].token_ids
            == kept.generate([prompt], sp)[0].token_ids)


def test_gather_of_nothing_maps_nothing() -> None:
    assert weight_arena.gather([]) == weight_arena.Gathered(0, 0, False)


def test_thp_setting_reads_the_bracketed_mode(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    monkeypatch.setattr(weight_arena, "THP_SETTING", f)
    assert weight_arena.huge_pages_setting() == "madvise"
    monkeypatch.setattr(weight_arena, "THP_SETTING", tmp_path / "absent")
    assert weight_arena.huge_pages_setting() is None
