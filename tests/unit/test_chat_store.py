"""`localllm chat`'s pieces without a model: the conversation store, the context guard's
bookkeeping, `/set`, slash-command parsing, multi-line blocks and completion."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from localllm.apps import chat_store
from localllm.apps.chat_commands import completer, set_param, show_params, split_command
from localllm.apps.chat_input import open_block, unquote
from localllm.apps.chat_store import Conversation, Store
from localllm.config import SamplingParams
from localllm.errors import LocalLLMError


def _conv(turns: int, system: str | None = "Be brief.") -> Conversation:
    conv = Conversation("c", system)
    for i in range(turns):
        conv.messages += [{"role": "user", "content": f"q{i}"},
                          {"role": "assistant", "content": f"a{i}"}]
    return conv


def test_save_load_round_trip_and_newest_first(tmp_path: Path) -> None:
    store = Store(tmp_path)
    first = _conv(2)
    first.messages[-1]["interrupted"] = True
    store.save(first)
    second = Conversation("b-2.x", None, [{"role": "user", "content": "héllo"}])
    path = store.save(second)
    assert path == tmp_path / "b-2.x.json"
    again = store.load("c")
    assert again.messages == first.messages and again.system == "Be brief."
    assert store.names() == ["b-2.x", "c"]
    store.save(first)  # saved last: listed first
    assert store.names() == ["c", "b-2.x"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b-2.x.json", "c.json"]  # no temps


def test_a_failed_write_keeps_the_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                           ) -> None:
    store = Store(tmp_path)
    store.save(_conv(1))
    before = (tmp_path / "c.json").read_text()

    def broken(*args: object, **kwargs: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(chat_store.json, "dump", broken)
    with pytest.raises(OSError):
        store.save(_conv(3))
    assert (tmp_path / "c.json").read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["c.json"]


def test_store_errors_are_one_line(tmp_path: Path) -> None:
    store = Store(tmp_path)
    with pytest.raises(LocalLLMError, match="no saved conversation 'nope'"):
        store.load("nope")
    with pytest.raises(LocalLLMError, match="conversation name '../x'"):
        store.path("../x")
    (tmp_path / "bad.json").write_text('{"messages": [{"role": "tool"}]}')
    with pytest.raises(LocalLLMError, match="cannot read conversation .*bad.json") as e:
        store.load("bad")
    assert "\n" not in str(e.value)
    assert store.names() == ["bad"]
    store.save(Conversation(store.new_name()))
    assert len({store.new_name(), *store.names()}) == 3  # a new name is never a saved one


def test_env_var_and_xdg_move_the_folders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                          ) -> None:
    monkeypatch.delenv(chat_store.ENV_DIR, raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    assert chat_store.conversations_dir() == tmp_path / "data" / "localllm" / "conversations"
    assert chat_store.history_path() == tmp_path / "state" / "localllm" / "chat_history"
    monkeypatch.setenv(chat_store.ENV_DIR, str(tmp_path / "mine"))
    assert chat_store.conversations_dir() == tmp_path / "mine"


def test_dropping_turns_keeps_the_system_prompt_and_the_last_message() -> None:
    conv = _conv(3)
    conv.messages.append({"role": "user", "content": "last"})
    assert conv.drop_oldest_turn() == 2
    assert conv.prompt()[0] == {"role": "system", "content": "Be brief."}
    assert [m["content"] for m in conv.prompt()[1:]] == ["q1", "a1", "q2", "a2", "last"]
    assert conv.drop_oldest_turn() == 2 and conv.drop_oldest_turn() == 2
    assert conv.drop_oldest_turn() == 0  # only the last message is left
    assert [m["content"] for m in conv.prompt()] == ["Be brief.", "last"]
    assert len(conv.messages) == 7  # the conversation itself keeps every turn
    assert conv.pop_turn() == {"role": "user", "content": "last"}
    assert conv.start == len(conv.messages) == 6


def test_pop_turn_takes_the_last_exchange() -> None:
    conv = _conv(2, system=None)
    assert conv.pop_turn() == {"role": "user", "content": "q1"}
    assert conv.prompt() == [{"role": "user", "content": "q0"},
                             {"role": "assistant", "content": "a0"}]
    conv.pop_turn()
    assert conv.pop_turn() is None and conv.prompt() == []


def test_set_every_sampling_parameter() -> None:
    p = SamplingParams(temperature=0.7)
    p = set_param(p, "temperature 0.3")
    p = set_param(p, "top_p 0.9")
    p = set_param(p, "top-k 20")
    p = set_param(p, "min_p 0.1")
    p = set_param(p, "repeat_penalty 1.1")
    p = set_param(p, "max_tokens 64")
    p = set_param(p, "seed 7")
    p = set_param(p, r'stop "\n\n" User:')
    assert p == SamplingParams(temperature=0.3, top_p=0.9, top_k=20, min_p=0.1,
                               repetition_penalty=1.1, max_tokens=64, seed=7,
                               stop=("\n\n", "User:"))
    shown = show_params(p)
    assert "temperature    0.3" in shown and "stop           '\\n\\n' 'User:'" in shown
    p = set_param(set_param(p, "seed none"), "stop none")
    assert p.seed is None and p.stop == ()


@pytest.mark.parametrize(("value", "stop"), [
    (r"\n", ("\n",)),  # unquoted: a newline too, as README says (a shell would give "n")
    (r"\n\n User:", ("\n\n", "User:")),
    (r'"\n\n" User:', ("\n\n", "User:")),
    (r"'\n' '###'", ("\n", "###")),
    (r"\t", ("\t",)),
    (r"C:\\n", ("C:\\n",)),  # \\ is one backslash
    (r"a\q", ("a\\q",)),  # a backslash before anything else stays
    ("'\"' '<|end|>'", ('"', "<|end|>")),
    ('"User: " #', ("User: ", "#")),
    ("off", ()),
])
def test_set_stop_reads_escapes_quoted_or_not(value: str, stop: tuple[str, ...]) -> None:
    assert set_param(SamplingParams(stop=("x",)), f"stop {value}").stop == stop


@pytest.mark.parametrize(("args", "message"), [
    ("temperature hot", "temperature takes a number"),
    ("top_k 1.5", "top_k takes a whole number"),
    ("top_p 2", "top_p must be in"),
    ("max_tokens 0", "max_tokens must be at least 1"),
    ("beam 4", "not a parameter; one of temperature"),
    ("temperature", "needs a value"),
    ("temperature nan", "temperature must be a finite number, got nan"),
    ("repeat_penalty inf", "repetition_penalty must be a finite number, got inf"),
    ('stop "User:', "a quote is not closed"),
])
def test_set_refuses_bad_values(args: str, message: str) -> None:
    with pytest.raises(LocalLLMError, match=message) as e:
        set_param(SamplingParams(), args)
    assert "\n" not in str(e.value)


def test_split_command() -> None:
    assert split_command("/set temperature 0.3") == ("/set", "temperature 0.3")
    assert split_command("  /EXIT ") == ("/exit", "")
    assert split_command("/quit") == ("/exit", "")
    assert split_command("/system Be\nbrief.") == ("/system", "Be\nbrief.")
    assert split_command("/usr/bin is a folder") is None
    assert split_command("hello /help") is None


def test_triple_quote_blocks() -> None:
    assert open_block('"""') and open_block('"""\nfirst line')
    assert not open_block('"""\nfirst\nlast"""') and not open_block('"""one line"""')
    assert not open_block("plain")
    assert unquote('"""\nfirst\nlast"""') == "first\nlast"
    assert unquote('"""one"""') == "one"
    assert unquote("  plain  ") == "plain"


def test_completion_of_commands_parameters_and_names() -> None:
    from prompt_toolkit.completion import CompleteEvent
    from prompt_toolkit.document import Document

    comp = completer(lambda: ["trip-notes", "todo"])

    def complete(text: str) -> list[str]:
        return [c.text for c in comp.get_completions(Document(text), CompleteEvent())]

    assert complete("/s") == ["/system", "/set", "/save", "/stats"]
    assert complete("/set te") == ["temperature"]
    assert complete("/set ") [-1] == "stop"
    assert complete("/load t") == ["trip-notes", "todo"]
    assert complete("/load tr") == ["trip-notes"]
    assert complete("hello /s") == []


def test_saved_file_is_plain_json(tmp_path: Path) -> None:
    conv = _conv(1)
    conv.model = "stories260K"
    data = json.loads(Store(tmp_path).save(conv).read_text())
    assert data["format"] == 1 and data["model"] == "stories260K"
    assert data["messages"] == conv.messages and data["system"] == "Be brief."
