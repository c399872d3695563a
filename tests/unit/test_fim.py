"""Fill-in-the-middle prompts: the FIM tokens found (declared or by their texts, with the
repository-level ones), and `infill_prompt`'s layout and budgets, token by token."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fim_model import write_fim_model
from gguf_factory import write_model

from localllm import LLM
from localllm.model_card import gguf_scalars
from localllm.text.fim import (
    FILE_NAME,
    REPO_NAME,
    SNIPPET,
    ExtraFile,
    FimTokens,
    fim_prompt,
    find_fim_tokens,
    infill_prompt,
)
from localllm.text.tokenizer import Tokenizer


def _load(path: Path) -> tuple[Tokenizer, dict[str, Any]]:
    return LLM(path, dtype="float32").tokenizer, gguf_scalars(path)


@pytest.fixture(scope="module")
def repo_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Tokenizer, FimTokens]:
    path = tmp_path_factory.mktemp("fim") / "repo.gguf"
    fim = write_fim_model(path, repo=True)
    return _load(path)[0], fim


@pytest.mark.parametrize("declared", [True, False])
@pytest.mark.parametrize("repo", [True, False])
def test_the_tokens_are_found(tmp_path: Path, declared: bool, repo: bool) -> None:
    path = tmp_path / "m.gguf"
    fim = write_fim_model(path, repo=repo, declared=declared)
    tok, meta = _load(path)
    found = find_fim_tokens(tok, meta)
    assert found == fim
    assert found is not None and found.end_ids == ((fim.repo, fim.file_sep) if repo else ())


def test_a_model_without_them_has_none(tmp_path: Path) -> None:
    write_model(tmp_path / "m.gguf")
    tok, meta = _load(tmp_path / "m.gguf")
    assert find_fim_tokens(tok, meta) is None


def _text(tok: Tokenizer, s: str) -> list[int]:
    return tok.encode(s, add_special=False)


def test_the_layout(repo_model: tuple[Tokenizer, FimTokens]) -> None:
    tok, fim = repo_model
    bos = [tok.bos_id] if tok.add_bos else []
    plain = infill_prompt(tok, fim, "def f(a):\n", "\n    return b\n", "    b = ")
    # the cursor's line so far goes after the prefix, tokenized apart, as in llama.cpp
    assert plain.ids == [*bos, fim.prefix, *_text(tok, "def f(a):\n"), *_text(tok, "    b = "),
                         fim.suffix, *_text(tok, "\n    return b\n"), fim.middle]
    assert fim_prompt(tok, fim, "x", "y") == [*bos, fim.prefix, *_text(tok, "x"), fim.suffix,
                                               *_text(tok, "y"), fim.middle]
    extra = [ExtraFile("a.py", "import os\n"), ExtraFile("b.py", "x = 1\n")]
    full = infill_prompt(tok, fim, "p", "s", "m", extra)
    assert full.ids == [
        *bos, fim.repo, *_text(tok, REPO_NAME + "\n"),
        fim.file_sep, *_text(tok, "a.py\n"), *_text(tok, "import os\n"),
        fim.file_sep, *_text(tok, "b.py\n"), *_text(tok, "x = 1\n"),
        fim.file_sep, *_text(tok, FILE_NAME + "\n"),
        fim.prefix, *_text(tok, "p"), *_text(tok, "m"), fim.suffix, *_text(tok, "s"), fim.middle]
    assert (full.dropped, full.cut) == (0, False)
    # the same extra files start every prompt the same way (the prefix cache reuses them)
    other = infill_prompt(tok, fim, "q = 2", "", "", extra)
    shared = len(full.ids) - len(plain.ids) + len(bos) + 1
    assert other.ids[:shared] == full.ids[:shared]


def test_without_repository_tokens_each_file_follows_a_snippet_line(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    fim = write_fim_model(path)
    tok, _ = _load(path)
    bos = [tok.bos_id] if tok.add_bos else []
    got = infill_prompt(tok, fim, "p", "s", extra=[ExtraFile("a.py", "one"),
                                                    ExtraFile("b.py", "two")])
    assert got.ids == [*bos, *_text(tok, SNIPPET), *_text(tok, "one"), *_text(tok, SNIPPET),
                       *_text(tok, "two"), fim.prefix, *_text(tok, "p"), fim.suffix,
                       *_text(tok, "s"), fim.middle]


def test_budgets(repo_model: tuple[Tokenizer, FimTokens]) -> None:
    tok, fim = repo_model
    prefix = "".join(f"line {i}\n" for i in range(60))
    suffix = "".join(f"after {i}\n" for i in range(60))
    pre, suf, mid = _text(tok, prefix), _text(tok, suffix), _text(tok, "ab")
    got = infill_prompt(tok, fim, prefix, suffix, "ab", local_budget=64)
    start = got.ids.index(fim.prefix)
    # the prefix keeps its last 48 tokens (nearest the cursor), the suffix its first
    # 16 less the FIM tokens' 2 and the middle's
    assert got.ids[start:] == [fim.prefix, *pre[-48:], *mid, fim.suffix,
                               *suf[:16 - 2 - len(mid)], fim.middle]
    assert got.cut and got.dropped == 0
    assert not infill_prompt(tok, fim, "a", "b", local_budget=64).cut
    # extra files: the oldest go first until the rest fit
    files = [ExtraFile(f"f{i}.py", "word " * 20) for i in range(4)]
    sizes = [1 + len(_text(tok, f"f{i}.py\n")) + len(_text(tok, "word " * 20))
             for i in range(4)]
    frame = 1 + len(_text(tok, REPO_NAME + "\n")) + 1 + len(_text(tok, FILE_NAME + "\n"))
    fits_two = infill_prompt(tok, fim, "p", "s", extra=files,
                             extra_budget=frame + sizes[2] + sizes[3])
    assert fits_two.dropped == 2
    assert fits_two.ids == infill_prompt(tok, fim, "p", "s", extra=files[2:]).ids
    none = infill_prompt(tok, fim, "p", "s", extra=files, extra_budget=frame)
    assert none.dropped == 4 and none.ids == infill_prompt(tok, fim, "p", "s").ids
