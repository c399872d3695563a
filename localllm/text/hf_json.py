"""Reading a Hugging Face tokenizer.json (+ tokenizer_config.json, generation_config.json)
into the plain data `Tokenizer.from_tokenizer_json` builds a tokenizer from."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from localllm.errors import ModelLoadError
from localllm.text import vocab as V


class HFTokenizerData(NamedTuple):
    """What a checkpoint folder says about its tokenizer (the `Tokenizer` arguments)."""

    tokens: list[str]
    attrs: list[int]  # vocab.NORMAL, CONTROL, ... per token
    pieces: str  # "bytes" (GPT-2 byte table) | "spm" (U+2581 and <0xNN>)
    special_ids: Mapping[str, int | None]  # bos, eos, unk, pad
    stop_ids: frozenset[int]
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    clean_spaces: bool
    chat_template: str | None
    hf: Any  # tokenizers.Tokenizer encoding special-token text as plain text
    hf_special: Any  # the same, parsing special tokens


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: unreadable JSON ({e})") from None
    return data if isinstance(data, dict) else {}


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(config: dict[str, Any], folder: Path) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    if template is None and (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    return template if isinstance(template, str) else None


def _components(node: Any) -> list[dict[str, Any]]:
    """A normalizer/pre-tokenizer/decoder node and, for a Sequence, its members."""
    if not isinstance(node, dict):
        return []
    members = node.get("decoders") or node.get("pretokenizers") or node.get("normalizers") or []
    return [node, *(m for m in members if isinstance(m, dict))]


def read_tokenizer_json(path: str | Path) -> HFTokenizerData:
    """A checkpoint folder's tokenizer (or a tokenizer.json file and the configs beside it)."""
    from tokenizers import Tokenizer as HFTokenizer

    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    folder = file.parent
    if not file.is_file():
        raise ModelLoadError(f"{file}: no such file (a Hugging Face tokenizer needs it)")
    spec = _read_json(file)
    try:
        hf = HFTokenizer.from_file(str(file))
        hf_special = HFTokenizer.from_file(str(file))
    except Exception as e:  # the tokenizers library raises plain Exceptions
        raise ModelLoadError(f"{file}: not a usable tokenizer.json ({e})") from None
    hf.encode_special_tokens = True  # special tokens in the text stay plain text
    config = _read_json(folder / "tokenizer_config.json")
    generation = _read_json(folder / "generation_config.json")

    n = hf.get_vocab_size(with_added_tokens=True)
    tokens = [""] * n
    for text, i in hf.get_vocab(with_added_tokens=True).items():
        if 0 <= i < n:
            tokens[i] = text
    tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
    attrs = [V.BYTE if V.byte_token_value(t) is not None else V.NORMAL for t in tokens]
    for i, added in hf.get_added_tokens_decoder().items():
        if 0 <= i < n:
            attrs[i] = V.CONTROL if added.special else V.USER_DEFINED
    model = spec.get("model") or {}
    unk_text = model.get("unk_token") if isinstance(model, dict) else None
    token_to_id = {t: i for i, t in enumerate(tokens)}

    def lookup(text: str | None) -> int | None:
        return token_to_id.get(text) if text is not None else None

    special_ids = {
        "bos": lookup(_token_content(config.get("bos_token"))),
        "eos": lookup(_token_content(config.get("eos_token"))),
        "unk": lookup(_token_content(config.get("unk_token")) or unk_text),
        "pad": lookup(_token_content(config.get("pad_token"))),
    }
    if special_ids["unk"] is not None:
        attrs[special_ids["unk"]] = V.UNKNOWN
    gen_eos = generation.get("eos_token_id")
    extra_eos = gen_eos if isinstance(gen_eos, list) else [gen_eos]
    stop_ids = V.end_of_generation_ids(tokens, attrs, {"eos": special_ids["eos"]})
    stop_ids |= {i for i in extra_eos if isinstance(i, int) and 0 <= i < n}

    # Whether the post-processor adds BOS/EOS, unless tokenizer_config.json says.
    probe_plain = hf.encode("a", add_special_tokens=False).ids
    probe = hf.encode("a", add_special_tokens=True).ids
    add_bos = config.get("add_bos_token")
    if not isinstance(add_bos, bool):
        add_bos = len(probe) > len(probe_plain) and probe[0] == special_ids["bos"]
    add_eos = config.get("add_eos_token")
    if not isinstance(add_eos, bool):
        add_eos = len(probe) > len(probe_plain) and probe[-1] == special_ids["eos"]

    decoders = _components(spec.get("decoder"))
    kinds = {d.get("type") for d in decoders}
    pieces = "bytes" if "ByteLevel" in kinds else "spm"
    add_space_prefix = any(
        (d.get("type") == "Strip" and d.get("start", 0) > 0)
        or (d.get("type") == "Metaspace" and d.get("prepend_scheme", "always") != "never")
        for d in decoders
    )
    return HFTokenizerData(
        tokens,
        attrs,
        pieces=pieces,
        special_ids=special_ids,
        stop_ids=stop_ids,
        add_bos=add_bos,
        add_eos=add_eos,
        add_space_prefix=add_space_prefix,
        clean_spaces=bool(config.get("clean_up_tokenization_spaces", False)),
        chat_template=_chat_template(config, folder),
        hf=hf,
        hf_special=hf_special,
    )
