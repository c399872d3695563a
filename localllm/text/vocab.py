"""Vocabulary facts shared by the tokenizer builders: token attributes, byte tables, pre-tokenizer
regexes and end-of-generation detection, following llama.cpp's `llama-vocab.cpp` conventions."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import NamedTuple

# Token attributes as bit flags (llama.cpp's llama_token_attr).
UNDEFINED = 0
UNKNOWN = 1 << 0
UNUSED = 1 << 1
NORMAL = 1 << 2
CONTROL = 1 << 3
USER_DEFINED = 1 << 4
BYTE = 1 << 5
LSTRIP = 1 << 7
RSTRIP = 1 << 8
SPECIAL = UNKNOWN | CONTROL  # hidden when special tokens are not rendered

# GGUF `tokenizer.ggml.token_type` values -> attributes.
GGUF_TOKEN_TYPE = {1: NORMAL, 2: UNKNOWN, 3: CONTROL, 4: USER_DEFINED, 5: UNUSED, 6: BYTE}

SPACE_MARK = "\u2581"  # SentencePiece's visible space
C_SPACES = " \t\n\v\f\r"  # C isspace(), used for lstrip/rstrip of special tokens


def _gpt2_byte_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet: printable bytes map to themselves, the rest to U+0100 on."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(0x100 + extra)] = b
            extra += 1
    return table


BYTE_LEVEL_CHARS = _gpt2_byte_table()  # char -> byte
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


_TO_BYTE = {ord(c): b for c, b in BYTE_LEVEL_CHARS.items()}  # str.translate: char -> chr(byte)
_DROP_TABLE_CHARS = dict.fromkeys(_TO_BYTE)  # str.translate: deletes every table character


def byte_level_bytes(text: str) -> bytes:
    """Raw bytes of a byte-level BPE piece; characters outside the table pass through as UTF-8."""
    if not text.translate(_DROP_TABLE_CHARS):  # all in the table (str.translate: C speed)
        return text.translate(_TO_BYTE).encode("latin-1")
    table = BYTE_LEVEL_CHARS
    return b"".join(bytes([table[c]]) if c in table else c.encode("utf-8") for c in text)


def byte_token_value(text: str) -> int | None:
    """The byte of a `<0xNN>` token, or None."""
    m = _BYTE_TOKEN.fullmatch(text)
    return int(m.group(1), 16) if m else None


_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")


class PreType(NamedTuple):
    regexes: tuple[str, ...]  # applied in turn, each splitting the pieces of the one before
    ignore_merges: bool  # a word that is a whole token skips the merges
    add_bos: bool  # llama.cpp's default when tokenizer.ggml.add_bos_token is absent
    clean_spaces: bool  # detokenize removes spaces before punctuation


_DEFAULT = PreType(
    (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"), False, False, True
)
_GPT2_PRE = PreType((_GPT2,), False, False, True)
_LLAMA3_PRE = PreType((_LLAMA3,), True, True, True)
_QWEN2_PRE = PreType((_QWEN2,), False, False, False)
PRE_TYPES: dict[str, PreType] = {
    "": _DEFAULT,
    "default": _DEFAULT,
    "gpt2": _GPT2_PRE,
    "gpt-2": _GPT2_PRE,
    "phi-2": _GPT2_PRE,
    "mpt": _GPT2_PRE,
    "olmo": _GPT2_PRE,
    "smollm": PreType((r"\p{N}", _GPT2), False, False, False),
    "starcoder": PreType((r"\p{N}", _GPT2), False, False, True),
    "refact": PreType((r"\p{N}", _GPT2), False, False, True),
    "llama3": _LLAMA3_PRE,
    "llama-v3": _LLAMA3_PRE,
    "llama-bpe": _LLAMA3_PRE,
    "falcon3": _LLAMA3_PRE,
    "qwen2": _QWEN2_PRE,
    "deepseek-r1-qwen": _QWEN2_PRE,
}

# Token texts that end generation (llama.cpp detects these by text as well as by id keys).
EOG_TEXTS = frozenset(
    {
        "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>",
        "<|calls|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>",
        "[EOT]", "[EOS]", "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>",
        "<|tool_response>", "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[",
    }
)  # fmt: skip
# Fill-in-the-middle tokens that llama.cpp also treats as end of generation.
FIM_EOG_TEXTS = (
    ("fim_pad", ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]")),
    ("fim_rep", ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")),
    ("fim_sep", ("<|file_sep|>",)),
)


def apply_name_quirks(tokens: Sequence[str], attrs: list[int], model_name: str) -> None:
    """llama.cpp's per-model token attribute fixes that change tokenization."""
    for i, text in enumerate(tokens):
        if text in ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"):
            attrs[i] = USER_DEFINED  # gpt-oss: always rendered
    name = model_name.lower()
    if "phi-3" in name or "phi3" in name:
        for i, text in enumerate(tokens):
            if attrs[i] & (CONTROL | USER_DEFINED | UNKNOWN) or text == "</s>":
                attrs[i] |= RSTRIP
            if text in ("<unk>", "<s>", "<|endoftext|>"):
                attrs[i] &= ~RSTRIP


def end_of_generation_ids(
    tokens: Sequence[str],
    attrs: list[int],
    key_ids: Mapping[str, int | None],
) -> frozenset[int]:
    """Ids that end generation; marks the text-detected ones CONTROL in `attrs` (in place).

    `key_ids` holds the ids from metadata: eos, eot, eom and fim_pad/fim_rep/fim_sep (None where
    absent).
    """
    eog: set[int] = set()
    for name, texts in FIM_EOG_TEXTS:
        tid = key_ids.get(name)
        if tid is None:
            found = [i for i, t in enumerate(tokens) if t in texts]
            tid = min(found) if found else None
            if tid is not None:
                attrs[tid] |= CONTROL
        if tid is not None:
            eog.add(tid)
    for i, text in enumerate(tokens):
        if text in EOG_TEXTS:
            eog.add(i)
            attrs[i] |= CONTROL
    for name in ("eos", "eot", "eom"):
        tid = key_ids.get(name)
        if tid is not None:
            eog.add(tid)
    by_text = {tokens[i]: i for i in eog}
    # gpt-oss / solar-open: "<|end|>" ends a message, not the generation.
    if "<|end|>" in by_text and (
        ("<|return|>" in by_text and "<|call|>" in by_text)
        or ("<|calls|>" in by_text and "<|flush|>" in by_text)
    ):
        eog.discard(by_text["<|end|>"])
        attrs[by_text["<|end|>"]] = USER_DEFINED
    return frozenset(eog)


def clean_up_spaces(text: str) -> str:
    """llama.cpp's clean_up_tokenization_spaces: " ." -> ".", " ' " -> "'", " 's" -> "'s"."""
    text = re.sub(r" ([?!.,])", r"\1", text)
    text = text.replace(" ' ", "'")
    return re.sub(r" '(?=[sm]|re|ve)", "'", text)
