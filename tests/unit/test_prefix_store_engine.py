"""The prefix store under the engine, on a small synthetic model: a new engine (a restart)
prefills only the uncached tail and samples the same tokens; bad entries and a full disk change
what is computed, never what is generated."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from gguf_factory import ModelSpec, write_model

from localllm import LLM, CacheConfig, SamplingParams
from localllm.engine import prefix_writer
from localllm.engine.prefix_entry import entry_path
from localllm.engine.request import Request

SPEC = ModelSpec(hidden=64, ffn=128, heads=4, kv_heads=2, layers=2)
PROMPT = [1] + [3 + (7 * i) % 280 for i in range(150)]  # 151 tokens: 9 full blocks stored
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("store-model") / "m.gguf", SPEC).path


def make_llm(path: Path, store: Path | None, backend: str = "cpu") -> LLM:
    cache = CacheConfig(num_blocks=64, prefix_cache=store is not None,
                        prefix_cache_dir=str(store) if store else None)
    return LLM(path, dtype="float32", cache=cache, device="cpu", backend=backend)


def run(llm: LLM, prompt: list[int] = PROMPT) -> Request:
    req = llm.engine.add_request(prompt, GREEDY)
    while llm.engine.has_unfinished():
        llm.engine.step()
    return req


def tail_tokens(req: Request) -> int:
    """Tokens the engine computed for `req`: its uncached prompt tail and its decode steps."""
    return req.num_tokens - 1 - req.num_cached_tokens


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_a_restarted_engine_prefills_only_the_uncached_tail(model_file: Path, tmp_path: Path,
                                                            backend: str) -> None:
    plain = run(make_llm(model_file, None, backend))
    first = make_llm(model_file, tmp_path, backend)
    cold = run(first)
    first.close()
    assert cold.num_cached_tokens == 0 and cold.output_ids == plain.output_ids
    second = make_llm(model_file, tmp_path, backend)
    warm = run(second)
    stored = (len(PROMPT) - 1) // 16 * 16
    assert warm.num_cached_tokens == stored
    assert second.engine.stats.tokens == tail_tokens(warm) == len(PROMPT) - stored + 11
    assert warm.output_ids == cold.output_ids
    snap = second.engine.snapshot()
    assert snap.prefix_hits == stored
    # a longer prompt with the same start: the stored blocks, then its own
    longer = run(second, PROMPT + [5, 6, 7, 8] * 10)
    fresh = run(make_llm(model_file, None, backend), PROMPT + [5, 6, 7, 8] * 10)
    assert longer.output_ids == fresh.output_ids
    second.close()


def test_a_bad_entry_is_recomputed_and_stored_again(model_file: Path, tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    first = make_llm(model_file, tmp_path)
    cold = run(first)
    first.close()
    second = make_llm(model_file, tmp_path)
    assert second.engine.store is not None
    keys = list(second.engine.bm._prompt_keys(PROMPT))
    bad = entry_path(second.engine.store.dir, keys[4].hash)
    raw = bytearray(bad.read_bytes())
    raw[-3] ^= 1
    bad.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="localllm"):
        warm = run(second)
    assert warm.num_cached_tokens == 4 * 16  # the blocks before the bad one
    assert warm.output_ids == cold.output_ids
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1
    second.close()
    assert bad.read_bytes() != bytes(raw)  # computed again and written whole
    third = make_llm(model_file, tmp_path)
    assert run(third).num_cached_tokens == (len(PROMPT) - 1) // 16 * 16
    third.close()


def test_another_model_backend_or_dtype_gets_nothing(model_file: Path, tmp_path: Path) -> None:
    first = make_llm(model_file, tmp_path)
    run(first)
    first.close()
    for llm in (make_llm(model_file, tmp_path, "torch"),
                LLM(model_file, dtype="bfloat16", device="cpu", cache=CacheConfig(
                    num_blocks=64, prefix_cache=True, prefix_cache_dir=str(tmp_path)))):
        assert run(llm).num_cached_tokens == 0
        llm.close()
    other_path = write_model(tmp_path / "other.gguf", ModelSpec(hidden=64, ffn=128, heads=4,
                                                                kv_heads=2, layers=2, seed=1)).path
    other = make_llm(other_path, tmp_path)
    assert run(other).num_cached_tokens == 0
    other.close()


def test_a_full_disk_changes_nothing_but_one_warning(
        model_file: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    def full(*args: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(prefix_writer, "write_entry", full)
    plain = run(make_llm(model_file, None))
    with caplog.at_level(logging.WARNING, logger="localllm"):
        llm = make_llm(model_file, tmp_path)
        outs = [run(llm, PROMPT[:n]) for n in (151, 120, 90)]
        assert llm.engine.store is not None
        llm.engine.store.flush()
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1 and "No space left" in warned[0]
    assert outs[0].output_ids == plain.output_ids
    assert outs[1].num_cached_tokens > 0  # the in-memory tier goes on
    llm.close()


def test_queued_blocks_are_written_when_the_process_exits(model_file: Path,
                                                           tmp_path: Path) -> None:
    script = f"""
import time
from localllm import LLM, CacheConfig, SamplingParams
from localllm.engine import prefix_writer
real = prefix_writer.write_entry
def slow_disk(*args):
    time.sleep(0.05)
    return real(*args)
prefix_writer.write_entry = slow_disk
llm = LLM({str(model_file)!r}, dtype="float32", device="cpu", cache=CacheConfig(
    num_blocks=64, prefix_cache=True, prefix_cache_dir={str(tmp_path)!r}))
llm.generate([{PROMPT!r}], SamplingParams(max_tokens=1, temperature=0))
"""  # exits without close(): the writer has 0.45 s of work left
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120,
                   env=dict(os.environ, OMP_NUM_THREADS="1"))
    again = make_llm(model_file, tmp_path)
    assert run(again).num_cached_tokens == (len(PROMPT) - 1) // 16 * 16
    again.close()
