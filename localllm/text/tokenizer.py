"""Tokenizer from GGUF metadata (token ids identical to llama.cpp's) or a Hugging Face
tokenizer.json, built on the `tokenizers` library.

GGUF vocabularies: special tokens are split out first, longest first, as llama.cpp does (control
and unknown tokens only when `parse_special`; user-defined tokens always). Byte-level BPE
(`tokenizer.ggml.model = "gpt2"`) text runs through a `tokenizers` BPE model with llama.cpp's
pre-tokenizer regexes; SentencePiece-style vocabularies (`"llama"`) through `spm_tokenize`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from functools import cached_property
from typing import Any, TypeGuard

from localllm.errors import ModelLoadError
from localllm.text import vocab as V
from localllm.text.hf_json import read_tokenizer_json
from localllm.text.spm import spm_tokenize
from localllm.text.string_table import StringTable, table_of

_Fragment = str | int  # raw text, or the id of a special token split out of it


class Tokenizer:
    """Text <-> token ids. Build with `from_gguf_metadata` or `from_tokenizer_json`."""

    def __init__(
        self,
        tokens: Sequence[str],
        attrs: list[int],
        *,
        kind: str,  # "spm" | "bpe" (GGUF vocabularies) | "hf" (tokenizer.json)
        pieces: str,  # "spm" (U+2581 and <0xNN>) | "bytes" (GPT-2 byte table)
        special_ids: Mapping[str, int | None],  # bos, eos, unk, pad
        stop_ids: Iterable[int],
        add_bos: bool,
        add_eos: bool,
        add_space_prefix: bool,
        clean_spaces: bool = False,
        chat_template: str | None = None,
        scores: Sequence[float] | None = None,
        hf: Any = None,  # tokenizers.Tokenizer encoding raw text (special tokens as plain text)
        hf_special: Any = None,  # "hf" kind: the same, parsing special tokens
    ) -> None:
        self._tokens = table_of(tokens)
        self._attrs = attrs
        self._kind = kind
        self._piece_style = pieces
        self.bos_id = special_ids.get("bos")
        self.eos_id = special_ids.get("eos")
        self.unk_id = special_ids.get("unk")
        self.pad_id = special_ids.get("pad")
        self.stop_ids = frozenset(stop_ids)
        self.add_bos = add_bos and self.bos_id is not None
        self.add_eos = add_eos and self.eos_id is not None
        self.add_space_prefix = add_space_prefix
        self.chat_template = chat_template
        self._clean_spaces = clean_spaces
        self._hf = hf
        self._hf_special = hf_special
        self._scores = scores if scores is not None else [0.0] * len(self._tokens)
        specials = [i for i, a in enumerate(attrs) if a & (V.CONTROL | V.USER_DEFINED | V.UNKNOWN)]
        specials.sort(key=lambda i: -self._tokens.byte_length(i))
        self._split_special = [(self._tokens[i], i, attrs[i]) for i in specials]
        self._split_plain = [s for s in self._split_special if not s[2] & V.SPECIAL]

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any], source: str = "") -> Tokenizer:
        """Build from GGUF key/values (`GGUFFile(path).metadata`); `source` names the file."""
        where = source or "GGUF metadata"
        model = meta.get("tokenizer.ggml.model")
        raw_tokens = meta.get("tokenizer.ggml.tokens")
        if model not in ("llama", "gpt2"):
            raise ModelLoadError(
                f"{where}: unsupported tokenizer.ggml.model {model!r} (supported: llama, gpt2)"
            )
        if not _is_sequence(raw_tokens) or not raw_tokens:
            raise ModelLoadError(f"{where}: tokenizer.ggml.tokens is missing or empty")
        n = len(raw_tokens)
        # decoded once for the passes below (a StringTable decodes on every read); the
        # tokenizer itself keeps the table
        texts = [str(t) for t in raw_tokens]
        empty = [i for i, t in enumerate(texts) if not t]
        for i in empty:
            texts[i] = f"[EMPTY_{i}]"
        tokens = raw_tokens if isinstance(raw_tokens, StringTable) and not empty else texts
        types = meta.get("tokenizer.ggml.token_type")
        if _is_sequence(types) and len(types) >= n:
            if not all(isinstance(t, int) for t in types[:n]):
                raise ModelLoadError(f"{where}: tokenizer.ggml.token_type holds non-integers")
            attrs = [V.GGUF_TOKEN_TYPE.get(t, V.UNDEFINED) for t in types[:n]]
        else:
            attrs = [V.NORMAL] * n
        spm = model == "llama"
        pre_name = str(meta.get("tokenizer.ggml.pre", "") or "")
        pre = V.PRE_TYPES.get(pre_name)
        if not spm and pre is None:
            raise ModelLoadError(f"{where}: unsupported tokenizer.ggml.pre {pre_name!r}")

        def token_id(key: str, default: int | None) -> int | None:
            value = meta.get(f"tokenizer.ggml.{key}_token_id")
            if isinstance(value, int) and 0 <= value < n:
                return value
            return default if default is not None and default < n else None

        special_ids = {
            "bos": token_id("bos", 1 if spm else 11),
            "eos": token_id("eos", 2 if spm else 11),
            "unk": token_id("unknown", 0 if spm else None),
            "pad": token_id("padding", None),
        }
        key_ids = {k: token_id(k, None) for k in ("eot", "eom", "fim_pad", "fim_rep", "fim_sep")}
        key_ids["eos"] = special_ids["eos"]
        stop_ids = V.end_of_generation_ids(texts, attrs, key_ids)
        V.apply_name_quirks(texts, attrs, str(meta.get("general.name", "")))
        add_bos = meta.get("tokenizer.ggml.add_bos_token", spm or (pre is not None and pre.add_bos))
        common: dict[str, Any] = dict(
            special_ids=special_ids,
            stop_ids=stop_ids,
            add_bos=bool(add_bos),
            add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
            add_space_prefix=bool(meta.get("tokenizer.ggml.add_space_prefix", spm)),
            chat_template=meta.get("tokenizer.chat_template"),
        )
        if spm:
            scores = meta.get("tokenizer.ggml.scores")
            if not _is_sequence(scores) or len(scores) < n:
                scores = [0.0] * n
            elif not all(isinstance(x, (int, float)) for x in scores[:n]):
                raise ModelLoadError(f"{where}: tokenizer.ggml.scores holds non-numbers")
            return cls(tokens, attrs, kind="spm", pieces="spm", scores=scores, **common)
        assert pre is not None
        hf = _byte_level_bpe(texts, meta.get("tokenizer.ggml.merges") or [], pre)
        return cls(
            tokens, attrs, kind="bpe", pieces="bytes", hf=hf, clean_spaces=pre.clean_spaces,
            **common,
        )  # fmt: skip

    @classmethod
    def from_tokenizer_json(cls, path: str | Any) -> Tokenizer:
        """Build from a Hugging Face checkpoint folder (or its tokenizer.json file)."""
        d = read_tokenizer_json(path)
        return cls(
            d.tokens, d.attrs, kind="hf", pieces=d.pieces, special_ids=d.special_ids,
            stop_ids=d.stop_ids, add_bos=d.add_bos, add_eos=d.add_eos,
            add_space_prefix=d.add_space_prefix, clean_spaces=d.clean_spaces,
            chat_template=d.chat_template, hf=d.hf, hf_special=d.hf_special,
        )

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    @property
    def bos_token(self) -> str:
        return self._tokens[self.bos_id] if self.bos_id is not None else ""

    @property
    def eos_token(self) -> str:
        return self._tokens[self.eos_id] if self.eos_id is not None else ""

    def is_special(self, token_id: int) -> bool:
        """Control or unknown token (hidden when decoding with skip_special)."""
        return bool(self._attrs[token_id] & V.SPECIAL)

    def token_text(self, token_id: int) -> str:
        """The vocabulary entry of a token, as stored (e.g. "Ġhello", "▁hello", "<0x0A>")."""
        return self._tokens[token_id]

    def encode(self, text: str, add_special: bool = True, parse_special: bool = False
               ) -> list[int]:
        """Token ids of `text`. `add_special` adds BOS/EOS as the model asks; `parse_special`
        turns text such as "<|im_start|>" into its special token (else it stays plain text)."""
        return self.encode_pieces([(text, parse_special)], add_special)

    def encode_pieces(self, pieces: Sequence[tuple[str, bool]], add_special: bool = False
                      ) -> list[int]:
        """Token ids of the concatenated `(text, parse_special)` pieces: special-token text is
        recognised only inside pieces that allow it, while plain text that spans pieces is
        tokenized as one run (so the ids equal those of the whole text when no disallowed piece
        holds special-token text)."""
        out: list[int] = []
        if add_special and self.add_bos and self.bos_id is not None:
            out.append(self.bos_id)
        if self._kind == "hf":
            for text, parse_special in pieces:
                if text:
                    hf = self._hf_special if parse_special else self._hf
                    out.extend(hf.encode(text, add_special_tokens=False).ids)
        else:
            fragments: list[_Fragment] = []
            for text, parse_special in pieces:
                for fragment in self._partition(text, parse_special):
                    if isinstance(fragment, str) and fragments and isinstance(fragments[-1], str):
                        fragments[-1] += fragment
                    else:
                        fragments.append(fragment)
            prev_special = True
            for fragment in fragments:
                if isinstance(fragment, int):
                    out.append(fragment)
                    prev_special = True
                else:
                    out.extend(self._encode_raw(fragment, prev_special))
                    prev_special = False
        if add_special and self.add_eos and self.eos_id is not None:
            out.append(self.eos_id)
        return out

    def _partition(self, text: str, parse_special: bool) -> list[_Fragment]:
        fragments: list[_Fragment] = [text] if text else []
        for token, token_id, attr in self._split_special if parse_special else self._split_plain:
            if not any(isinstance(f, str) and token in f for f in fragments):
                continue
            split: list[_Fragment] = []
            for fragment in fragments:
                if isinstance(fragment, int) or token not in fragment:
                    split.append(fragment)
                    continue
                parts = fragment.split(token)
                for k, part in enumerate(parts):
                    if k:
                        split.append(token_id)
                        if attr & V.RSTRIP:
                            part = part.lstrip(V.C_SPACES)
                    if k < len(parts) - 1 and attr & V.LSTRIP:
                        part = part.rstrip(V.C_SPACES)
                    if part:
                        split.append(part)
            fragments = split
        return fragments

    def _encode_raw(self, text: str, prev_special: bool) -> list[int]:
        if self._kind == "spm":
            if self.add_space_prefix and prev_special:
                text = " " + text
            escaped = text.replace(" ", V.SPACE_MARK)
            return spm_tokenize(escaped, self._token_to_id, self._scores, self._byte_ids)
        return list(self._hf.encode(text, add_special_tokens=False).ids)

    @cached_property
    def _token_to_id(self) -> dict[str, int]:
        # SentencePiece-style vocabularies only: byte-level BPE looks tokens up in `_hf`
        return {t: i for i, t in enumerate(self._tokens)}

    @cached_property
    def _byte_ids(self) -> list[int]:
        fallback = self.unk_id if self.unk_id is not None else -1
        ids = []
        for b in range(256):
            tid = self._token_to_id.get(f"<0x{b:02X}>")
            if tid is None:
                tid = self._token_to_id.get(chr(b), fallback)
            ids.append(tid)
        return ids

    @cached_property
    def _pieces(self) -> StringTable:
        """Each token's bytes as decoding emits them."""
        return StringTable.from_bytes(self._piece(text, attr)
                                      for text, attr in zip(self._tokens, self._attrs, strict=True))

    def _piece(self, text: str, attr: int) -> bytes:
        if attr & (V.SPECIAL | V.USER_DEFINED):
            return text.encode("utf-8")
        if attr & V.NORMAL:
            if self._piece_style == "spm":
                return text.replace(V.SPACE_MARK, " ").encode("utf-8")
            return V.byte_level_bytes(text)
        if attr & V.BYTE:
            value = V.byte_token_value(text)
            return bytes([value]) if value is not None else b""
        return b""  # unused or undefined tokens render as nothing

    def prepare_decoding(self) -> None:
        """Build the table of each token's bytes now, which the first `token_to_bytes` would
        otherwise build (about 60 ms for a 49,152-token byte-level vocabulary)."""
        _ = self._pieces

    def token_to_bytes(self, token_id: int) -> bytes:
        """Raw bytes of one token (special tokens give their text)."""
        if not 0 <= token_id < len(self._tokens):
            raise ValueError(f"token id {token_id} is outside the vocabulary of {self.vocab_size}")
        return self._pieces.raw(token_id)

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of `ids`, as llama.cpp's detokenize (remove_special = unparse_special negated
        = skip_special); invalid UTF-8 becomes U+FFFD."""
        ids = list(ids)
        remove_space = self.add_space_prefix
        if skip_special and self.add_bos and ids and ids[0] == self.bos_id:
            remove_space = False
            ids = ids[1:]
        if skip_special and self.add_eos and ids and ids[-1] == self.eos_id:
            ids = ids[:-1]
        parts = []
        for token_id in ids:
            hidden = skip_special and self.is_special(token_id)
            piece = b"" if hidden else self.token_to_bytes(token_id)
            if remove_space and piece.startswith(b" "):
                piece = piece[1:]
            remove_space = False
            parts.append(piece)
        text = b"".join(parts).decode("utf-8", errors="replace")
        return V.clean_up_spaces(text) if self._clean_spaces else text


def _is_sequence(value: object) -> TypeGuard[Sequence[Any]]:
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes))


def _byte_level_bpe(tokens: Sequence[str], merges: Sequence[str], pre: V.PreType) -> Any:
    """A `tokenizers` BPE over the whole vocabulary (no added tokens: special tokens are split
    out before it runs), with llama.cpp's pre-tokenizer regexes and the GPT-2 byte table."""
    from tokenizers import Regex, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    vocab = {t: i for i, t in enumerate(tokens)}
    pairs: dict[tuple[str, str], None] = {}
    for merge in merges:
        pos = merge.find(" ", 1)
        if pos < 0:
            continue
        left, right = merge[:pos], merge[pos + 1 :]
        # NOTE: the first rank of a duplicated pair wins, as in llama.cpp.
        if left in vocab and right in vocab and left + right in vocab:
            pairs.setdefault((left, right), None)
    hf = HFTokenizer(models.BPE(vocab, list(pairs), ignore_merges=pre.ignore_merges))
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.pre_tokenizer = pre_tokenizers.Sequence([*splits, byte_level])
    return hf
