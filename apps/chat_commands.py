"""`localllm chat`'s slash commands: their help, `/set`'s sampling parameters, completion."""

from __future__ import annotations

import dataclasses
import re
import shlex
from collections.abc import Callable, Iterable
from typing import Any

from localllm.config import SamplingParams
from localllm.errors import LocalLLMError, RequestError

COMMANDS = {  # name: (arguments, what it does)
    "/help": ("", "this help"),
    "/system": ("TEXT", "set the system prompt and start over (alone: show it)"),
    "/reset": ("", "start a new conversation (the current one stays saved)"),
    "/retry": ("", "answer the last message again"),
    "/undo": ("", "take back the last message and its reply"),
    "/set": ("NAME VALUE", "set a sampling parameter, e.g. /set temperature 0.3 (alone: "
             "show them)"),
    "/save": ("NAME", "save the conversation as NAME (it goes on under that name)"),
    "/load": ("NAME", "continue a saved conversation"),
    "/list": ("", "the saved conversations, newest first"),
    "/stats": ("", "time to first token, tokens/s, prompt and cached tokens of the last reply"),
    "/exit": ("", "leave (also /quit, Ctrl-D, or Ctrl-C twice at an empty prompt)"),
}
ALIASES = {"/quit": "/exit", "/bye": "/exit", "/?": "/help"}

KEYS = """\
Enter sends. Esc-Enter (or Alt-Enter) starts a new line; so does Enter inside a block that
begins with \"\"\" (the block ends, and is sent, with a line ending in \"\"\").
Ctrl-C stops a reply (the part shown is kept, marked as stopped); Ctrl-R searches the history.
Conversations are saved after every reply; `localllm chat --resume [NAME]` continues one."""


def help_text() -> str:
    usage = {name: f"{name} {args}".strip() for name, (args, _) in COMMANDS.items()}
    width = max(map(len, usage.values()))
    lines = [f"{usage[name]:<{width}}  {text}" for name, (_, text) in COMMANDS.items()]
    return "\n".join(lines) + "\n" + KEYS


def _optional_int(text: str) -> int | None:
    return None if text.lower() in ("none", "off", "random") else int(text)


_ESCAPES = {"n": "\n", "t": "\t", "\\": "\\"}


def _unescape(text: str) -> str:
    """`\\n` -> newline, `\\t` -> tab, `\\\\` -> one backslash; other backslashes stay."""
    return re.sub(r"\\([nt\\])", lambda m: _ESCAPES[m.group(1)], text)


def stop_words(value: str) -> tuple[str, ...]:
    """`/set stop`'s value as stop strings: shell words (quotes group, as in a shell), but a
    backslash is no shell escape: `\\n` means a newline quoted or not (a shell would make
    `\\n` unquoted the letter n)."""
    lex = shlex.shlex(value, posix=True)
    lex.whitespace_split = True
    lex.escape = ""  # keep backslashes for _unescape
    lex.commenters = ""
    try:
        words = list(lex)
    except ValueError:  # "No closing quotation"
        raise LocalLLMError(f"/set stop {value}: a quote is not closed; close it (a quote "
                            f"character itself goes inside the other kind: '\"')") from None
    return () if words in (["none"], ["off"]) else tuple(map(_unescape, words))


# /set NAME -> (SamplingParams field, parse one value)
PARAMS: dict[str, tuple[str, Callable[[str], Any]]] = {
    "temperature": ("temperature", float),
    "top_p": ("top_p", float),
    "top_k": ("top_k", int),
    "min_p": ("min_p", float),
    "repeat_penalty": ("repetition_penalty", float),
    "max_tokens": ("max_tokens", int),
    "seed": ("seed", _optional_int),
}
SET_NAMES = (*PARAMS, "stop")


def show_params(p: SamplingParams) -> str:
    rows = [(name, getattr(p, attr)) for name, (attr, _) in PARAMS.items()]
    rows.append(("stop", " ".join(repr(s) for s in p.stop) or "none"))
    return "\n".join(f"{name:<15}{'none' if v is None else v}" for name, v in rows)


def set_param(p: SamplingParams, args: str) -> SamplingParams:
    """`/set NAME VALUE`: the new parameters (LocalLLMError with what to type instead)."""
    name, _, value = args.strip().partition(" ")
    name = name.replace("-", "_").lower()
    if name == "repetition_penalty":
        name = "repeat_penalty"
    value = value.strip()
    if name not in SET_NAMES:
        raise LocalLLMError(f"/set {name}: not a parameter; one of {', '.join(SET_NAMES)}")
    if not value:
        raise LocalLLMError(f"/set {name} needs a value, e.g. /set temperature 0.3")
    try:
        if name == "stop":  # shell words: /set stop "\n\n" User:; /set stop \n; none
            return dataclasses.replace(p, stop=stop_words(value))
        attr, parse = PARAMS[name]
        return dataclasses.replace(p, **{attr: parse(value)})
    except ValueError:
        kind = "whole number" if name in ("top_k", "max_tokens", "seed") else "number"
        raise LocalLLMError(f"/set {name} {value}: {name} takes a {kind}") from None
    except RequestError as e:
        raise LocalLLMError(f"/set {name} {value}: {e}") from None


def split_command(line: str) -> tuple[str, str] | None:
    """('/name', rest) when `line` is a slash command (a word of letters after '/'), else
    None: `/usr/bin is...` is a message."""
    m = re.fullmatch(r"(/[a-z?]+)(?:\s+(.*))?", line.strip(), re.DOTALL | re.IGNORECASE)
    if m is None:
        return None
    cmd = m.group(1).lower()
    return ALIASES.get(cmd, cmd), (m.group(2) or "").strip()


def completer(saved_names: Callable[[], Iterable[str]]) -> Any:
    """prompt-toolkit completion: command names, `/set`'s parameters, `/load`'s saved
    conversations."""
    from prompt_toolkit.completion import Completer, Completion

    class SlashCompleter(Completer):
        def get_completions(self, document: Any, complete_event: Any) -> Iterable[Completion]:
            text = document.text_before_cursor
            if not text.startswith("/") or "\n" in text:
                return
            cmd, space, rest = text.partition(" ")
            if not space:
                for name in COMMANDS:
                    if name.startswith(cmd.lower()):
                        yield Completion(name, -len(cmd), display_meta=COMMANDS[name][1])
                return
            if " " in rest:
                return
            options: Iterable[str] = ()
            if cmd == "/set":
                options = SET_NAMES
            elif cmd == "/load":
                options = saved_names()
            for option in options:
                if option.startswith(rest):
                    yield Completion(option, -len(rest))

    return SlashCompleter()
