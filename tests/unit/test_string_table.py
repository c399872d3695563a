"""StringTable: a vocabulary held as one blob, and the GGUF reader handing string arrays out
as such tables."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFValueType as VT
from gguf_factory import ModelSpec, write_model

from localllm.gguf.reader import GGUFFile
from localllm.text.string_table import StringTable, table_of

WORDS = ["<s>", "", "héllo", "▁world", "日本", "a b"]


def test_a_table_reads_like_the_list_it_holds() -> None:
    t = StringTable.from_strings(WORDS)
    assert len(t) == len(WORDS)
    assert list(t) == WORDS and t == WORDS and t[:2] == WORDS[:2]
    assert [t[i] for i in range(-len(WORDS), len(WORDS))] == WORDS + WORDS
    assert t.raw(2) == "héllo".encode() and t.byte_length(4) == 6 and t.byte_length(1) == 0
    with pytest.raises(IndexError):
        t[len(WORDS)]
    assert t != WORDS[:-1] and t != [*WORDS[:-1], "x"]
    assert table_of(t) is t and table_of(WORDS) == t
    assert t.nbytes < 100


def test_bytes_that_are_not_utf8_decode_to_replacement_characters() -> None:
    t = StringTable.from_bytes([b"ok", b"\xff\xfe", b""])
    assert t.raw(1) == b"\xff\xfe"
    assert list(t) == ["ok", "\ufffd\ufffd", ""]


def test_a_table_over_a_blob_with_gaps() -> None:
    # the GGUF reader's form: each string preceded by its 8-byte length
    blob = b"\x02\0\0\0\0\0\0\0hi\x03\0\0\0\0\0\0\0you"
    t = StringTable(blob, np.array([8, 18]), np.array([10, 21]))
    assert list(t) == ["hi", "you"]


def test_gguf_string_arrays_load_as_tables(tmp_path: Path) -> None:
    merges = ["a b", "ab c", "é ü"]
    spec = ModelSpec(keys={"tokenizer.ggml.merges": (merges, VT.ARRAY)})
    written = write_model(tmp_path / "m.gguf", spec)
    meta = GGUFFile(written.path).metadata
    tokens = meta["tokenizer.ggml.tokens"]
    assert isinstance(tokens, StringTable)
    assert tokens == written.metadata["tokenizer.ggml.tokens"]
    assert isinstance(meta["tokenizer.ggml.merges"], StringTable)
    assert list(meta["tokenizer.ggml.merges"]) == merges
    assert isinstance(meta["tokenizer.ggml.scores"], list)  # numbers stay plain lists
