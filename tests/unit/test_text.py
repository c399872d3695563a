"""Unit tests for localllm.text: chat templates, tokenizer, detokenizer, stop strings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from localllm.errors import ModelLoadError, TemplateError
from localllm.text import ChatTemplate, IncrementalDetokenizer, StopChecker, Tokenizer

# -- chat templates ------------------------------------------------------------------------

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]


def test_chatml_default() -> None:
    t = ChatTemplate(None, "<s>", "</s>")
    want = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
    assert t.render(MESSAGES, add_generation_prompt=False) == want
    assert t.render(MESSAGES) == want + "<|im_start|>assistant\n"


def test_template_variables_filters_and_whitespace_control() -> None:
    source = (  # trim_blocks eats the newline after a block tag, lstrip_blocks the indent
        "{{ bos_token }}{% for m in messages %}\n  {% if m %}{{ m['role'] }}{% endif %}="
        "{{ m['content'] | tojson }}\n{% endfor %}\n"
        "  {% if add_generation_prompt %}{{ greeting }}{% endif %}{{ strftime_now('%Y') | length }}"
    )
    out = ChatTemplate(source, "<s>", "</s>").render(
        [{"role": "user", "content": 'héllo "x"'}], extra={"greeting": "GO"}
    )
    assert out == '<s>user="héllo \\"x\\""\nGO4'


def test_raise_exception_becomes_template_error() -> None:
    t = ChatTemplate("{{ raise_exception('Roles must\nalternate') }}", "", "")
    with pytest.raises(TemplateError, match="^chat template error: Roles must alternate$"):
        t.render(MESSAGES)


@pytest.mark.parametrize(
    "source",
    [
        "{% for m in messages %}{{ m }}",  # syntax: unclosed block
        "{{ 1 / 0 }}",  # runtime error
        "{{ messages[0]['content'].nope() }}",  # calling an undefined
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",  # sandbox
        "{% set x = [] %}{{ x.append(1) }}",  # immutable sandbox
    ],
)
def test_template_errors_are_one_line(source: str) -> None:
    with pytest.raises(TemplateError) as info:
        ChatTemplate(source, "", "").render(MESSAGES)
    message = str(info.value)
    assert message.startswith("chat template error: ") and "\n" not in message


# -- tokenizer -----------------------------------------------------------------------------


def test_unsupported_vocab_is_a_load_error() -> None:
    with pytest.raises(ModelLoadError, match="unsupported tokenizer.ggml.model"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "t5", "tokenizer.ggml.tokens": ["a"]})
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": ["a"],
        "tokenizer.ggml.pre": "?",
    }
    with pytest.raises(ModelLoadError, match="unsupported tokenizer.ggml.pre"):
        Tokenizer.from_gguf_metadata(meta)


def test_from_tokenizer_json(tmp_path: Path) -> None:
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models, pre_tokenizers

    chars = [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["Ġ", "<", ">", "|", "_", "Ċ"]
    vocab = {c: i for i, c in enumerate(chars)} | {"Ġh": len(chars), "Ġhi": len(chars) + 1}
    hf = HF(models.BPE(vocab, [("Ġ", "h"), ("Ġh", "i")]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    hf.save(str(tmp_path / "tokenizer.json"))
    config = {
        "bos_token": "<|im_start|>",
        "eos_token": {"content": "<|im_end|>"},
        "chat_template": "T",
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_tokenizer_json(tmp_path)
    start, end = tok.bos_id, tok.eos_id
    assert (tok.bos_token, tok.eos_token, tok.chat_template) == ("<|im_start|>", "<|im_end|>", "T")
    assert tok.stop_ids == {end} and not tok.add_bos and tok.is_special(start)
    assert tok.encode("<|im_start|>a hi", parse_special=True) == [start, 0, vocab["Ġhi"]]
    plain = tok.encode("<|im_start|>a hi")
    assert start not in plain and tok.decode(plain) == "<|im_start|>a hi"


# -- incremental detokenizer ---------------------------------------------------------------


class _FakePieces:
    PIECES = [b" Hel", b"lo ", "é".encode()[:1], "é".encode()[1:], b"<|end|>", b"\xff", b"\xf0\x9f"]

    def token_to_bytes(self, token_id: int) -> bytes:
        return self.PIECES[token_id]

    def is_special(self, token_id: int) -> bool:
        return token_id == 4


def test_detokenizer_buffers_partial_characters() -> None:
    d = IncrementalDetokenizer(_FakePieces(), strip_leading_space=True)
    assert [d.add(i) for i in (0, 1, 2, 3, 4)] == ["Hel", "lo ", "", "é", ""]
    assert d.add(5) == "\ufffd" and d.add(6) == "" and d.flush() == "\ufffd"
    shown = IncrementalDetokenizer(_FakePieces(), skip_special=False)
    assert shown.add(0) + shown.add(4) == " Hel<|end|>"


# -- stop strings --------------------------------------------------------------------------


def test_stop_string_split_across_pieces() -> None:
    s = StopChecker(["<|im_end|>", "###"])
    assert s.feed("Hello <|im") == ("Hello ", False)
    assert s.feed("_e") == ("", False)
    assert s.feed("nd|> tail") == ("", True)
    assert s.feed("more") == ("", True) and s.flush() == ""


def test_stop_checker_releases_false_alarms() -> None:
    s = StopChecker(["abc"])
    assert s.feed("xab") == ("x", False)
    assert s.feed("d") == ("abd", False)
    assert s.feed("a") == ("", False)
    assert s.flush() == "a"
    assert StopChecker([]).feed("anything") == ("anything", False)


def test_stop_checker_waits_for_a_longer_stop_that_began_earlier() -> None:
    s = StopChecker(["<", "><<"])
    assert s.feed("><") == ("", False)  # "<" is here, but "><<" may begin before it
    assert s.feed("<") == ("", True)
    t = StopChecker(["<", "><<"])
    assert t.feed("><") == ("", False)
    assert t.flush() == ">" and t.stopped  # the stream ended: "<" was the first stop


@given(
    st.text(alphabet="ab<|>x", max_size=40),
    st.lists(st.integers(0, 40), max_size=6),
    st.lists(st.text(alphabet="ab<|>", min_size=1, max_size=4), min_size=1, max_size=3),
)
def test_stop_checker_matches_whole_text_search(
    text: str, cuts: list[int], stops: list[str]
) -> None:
    bounds = sorted({0, len(text), *(min(c, len(text)) for c in cuts)})
    checker = StopChecker(stops)
    shown, hit = "", False
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        out, hit = checker.feed(text[lo:hi])
        shown += out
        if hit:
            break
    if not hit:
        shown += checker.flush()
        hit = checker.stopped  # a stop string completed by the end of the stream
    first = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    assert hit == (first >= 0)
    assert shown == (text[:first] if first >= 0 else text)
