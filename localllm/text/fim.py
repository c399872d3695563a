"""Fill-in-the-middle prompts from a vocabulary's FIM tokens.

The tokens are those the GGUF declares (`tokenizer.ggml.fim_{pre,suf,mid}_token_id`, or the
older `tokenizer.ggml.{prefix,suffix,middle}_token_id`), else the first family of known token
texts the vocabulary has as special tokens (`<|fim_prefix|>`, `<fim_prefix>`, `<PRE>`, ...), as
llama.cpp looks for them; the repository-level tokens (`fim_rep`/`fim_sep`: `<|repo_name|>` and
`<|file_sep|>`, or `<repo_name>` and `<file_sep>`) likewise, where the model has them.

The prompt is prefix-suffix-middle, as llama.cpp's infill builds it:
`[BOS] <fim_prefix> PREFIX LINE <fim_suffix> SUFFIX <fim_middle>`, the code tokenized as plain
text (LINE: the cursor's line up to the cursor, which llama.cpp's editor clients send apart).
`infill_prompt` puts other files' text (an editor's extra context) before it: after
`<repo_name>`, each file under a `<file_sep>` header and then the edited file's header, where
the model has those tokens; else each after a plain-text snippet line.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from localllm.text.tokenizer import Tokenizer

_KEYS = (("fim_pre", "fim_suf", "fim_mid"), ("prefix", "suffix", "middle"))
_TEXTS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder, StarCoder2
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, SantaCoder
    ("<fim-prefix>", "<fim-suffix>", "<fim-middle>"),
    ("<PRE>", "<SUF>", "<MID>"),  # Code Llama
    ("<|fim▁begin|>", "<|fim▁hole|>", "<|fim▁end|>"),  # DeepSeek-Coder
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),
)
_REPO_TEXTS = (("<|repo_name|>", "<|file_sep|>"), ("<repo_name>", "<file_sep>"))
_PAD_TEXTS = ("<|fim_pad|>", "<fim_pad>")
REPO_NAME = "project"  # the repository name of a repo-level prompt (editors do not send one)
FILE_NAME = "file"  # the edited file's name there, likewise
SNIPPET = "\n\n--- snippet ---\n\n"  # what goes before each extra file without repo tokens


class FimTokens(NamedTuple):
    prefix: int
    suffix: int
    middle: int
    repo: int | None = None  # <repo_name>: starts a repository-level prompt
    file_sep: int | None = None  # <file_sep>: starts each file of it
    pad: int | None = None

    @property
    def end_ids(self) -> tuple[int, ...]:
        """Tokens that end a completion when sampled, as llama.cpp ends one (a file separator,
        a repository header or padding means the model has left the hole)."""
        return tuple(i for i in (self.repo, self.file_sep, self.pad) if i is not None)


class ExtraFile(NamedTuple):
    """Text from another file (or elsewhere in this one) that the completion may draw on."""

    filename: str
    text: str


class InfillPrompt(NamedTuple):
    ids: list[int]
    dropped: int  # extra files left out (the oldest first) to fit the budget
    cut: bool  # the prefix or the suffix was shortened to fit


def _special_id(tokenizer: Tokenizer, text: str) -> int | None:
    ids = tokenizer.encode(text, add_special=False, parse_special=True)
    if len(ids) == 1 and tokenizer.token_text(ids[0]) == text:
        return ids[0]
    return None


def _declared(meta: Mapping[str, Any], key: str, vocab: int) -> int | None:
    value = meta.get(f"tokenizer.ggml.{key}_token_id")
    return value if isinstance(value, int) and 0 <= value < vocab else None


def find_fim_tokens(tokenizer: Tokenizer,
                    metadata: Mapping[str, Any] | None = None) -> FimTokens | None:
    """The vocabulary's FIM tokens, or None when it has no complete prefix/suffix/middle set."""
    meta = metadata or {}
    vocab = tokenizer.vocab_size
    main: list[int | None] = []
    for keys in _KEYS:
        main = [_declared(meta, k, vocab) for k in keys]
        if all(i is not None for i in main):
            break
    else:
        for texts in _TEXTS:
            main = [_special_id(tokenizer, t) for t in texts]
            if all(i is not None for i in main):
                break
        else:
            return None
    repo, sep = _declared(meta, "fim_rep", vocab), _declared(meta, "fim_sep", vocab)
    if repo is None or sep is None:
        for pair in _REPO_TEXTS:
            repo, sep = (_special_id(tokenizer, t) for t in pair)
            if repo is not None and sep is not None:
                break
        else:
            repo = sep = None
    pad = _declared(meta, "fim_pad", vocab)
    if pad is None:
        pad = next((i for t in _PAD_TEXTS if (i := _special_id(tokenizer, t)) is not None), None)
    pre, suf, mid = main
    assert pre is not None and suf is not None and mid is not None
    return FimTokens(pre, suf, mid, repo=repo, file_sep=sep, pad=pad)


def fim_prompt(tokenizer: Tokenizer, fim: FimTokens, prefix: str, suffix: str) -> list[int]:
    """Prompt ids that ask the model for the text between `prefix` and `suffix`."""
    return infill_prompt(tokenizer, fim, prefix, suffix).ids


def _text(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special=False, parse_special=False)


def _extra_ids(tokenizer: Tokenizer, fim: FimTokens, extra: Sequence[ExtraFile]
               ) -> tuple[list[int], list[list[int]], list[int]]:
    """(header, one id list per extra file, the edited file's header)."""
    repo_level = fim.repo is not None and fim.file_sep is not None
    if repo_level:
        head = [fim.repo, *_text(tokenizer, REPO_NAME + "\n")]
        tail = [fim.file_sep, *_text(tokenizer, FILE_NAME + "\n")]
        files = [[fim.file_sep, *_text(tokenizer, f.filename + "\n"), *_text(tokenizer, f.text)]
                 for f in extra]
        return head, files, tail  # type: ignore[return-value]
    snippet = _text(tokenizer, SNIPPET)
    return [], [snippet + _text(tokenizer, f.text) for f in extra], []


def infill_prompt(tokenizer: Tokenizer, fim: FimTokens, prefix: str, suffix: str,
                  middle: str = "", extra: Sequence[ExtraFile] = (),
                  local_budget: int | None = None, extra_budget: int | None = None
                  ) -> InfillPrompt:
    """The ids of a fill-in-the-middle prompt: the model writes what goes between `prefix` +
    `middle` (the cursor's line up to the cursor, tokenized apart and put after the prefix) and
    `suffix`, with `extra` files before it.

    With `local_budget`, the prefix keeps at most its last 3/4 of that many tokens and the
    suffix its first quarter less the middle's tokens and 2, as llama.cpp's infill does; with
    `extra_budget`, the oldest extra files (the first) are left out until the rest fit. Each
    piece is tokenized alone, so a prompt that shares the extra files of an earlier one shares
    its first tokens too (the prefix cache then reuses them).
    """
    pre, suf, mid = _text(tokenizer, prefix), _text(tokenizer, suffix), _text(tokenizer, middle)
    cut = False
    if local_budget is not None:
        keep_pre = 3 * (local_budget // 4)
        keep_suf = max(0, local_budget // 4 - 2 - len(mid))
        cut = len(pre) > keep_pre or len(suf) > keep_suf
        pre = pre[len(pre) - keep_pre:] if len(pre) > keep_pre else pre
        suf = suf[:keep_suf]
    head, files, tail = _extra_ids(tokenizer, fim, extra)
    dropped = 0
    if extra_budget is not None:
        room = extra_budget - len(head) - len(tail)
        total = sum(map(len, files))
        while dropped < len(files) and total > room:
            total -= len(files[dropped])
            dropped += 1
        files = files[dropped:]
    ids = [tokenizer.bos_id] if tokenizer.add_bos and tokenizer.bos_id is not None else []
    if files:  # with no extra files, the plain prompt (no repository header)
        ids += head + [t for f in files for t in f] + tail
    ids += [fim.prefix, *pre, *mid, fim.suffix, *suf, fim.middle]
    return InfillPrompt(ids, dropped, cut)
