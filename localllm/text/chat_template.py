"""Chat templates rendered in jinja2's immutable sandbox, as Hugging Face transformers does."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, NoReturn

import jinja2
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from localllm.errors import TemplateError

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _raise_exception(message: str) -> NoReturn:
    raise TemplateError(f"chat template error: {_one_line(message)}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """A model's chat template; ChatML when the model has none."""

    def __init__(self, source: str | None, bos_token: str = "", eos_token: str = "") -> None:
        self.source = source if source else CHATML_TEMPLATE
        self.bos_token = bos_token
        self.eos_token = eos_token
        env = _environment()
        try:
            self._template = env.from_string(self.source)
            names = jinja2.meta.find_undeclared_variables(env.parse(self.source))
        except jinja2.TemplateSyntaxError as e:
            raise TemplateError(
                f"chat template error: {_one_line(e.message or str(e))} (line {e.lineno})"
            ) from None
        self.takes_tools = "tools" in names or "custom_tools" in names

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        extra: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text for `messages`; `extra` adds template variables (tools, ...)."""
        context: dict[str, Any] = {"bos_token": self.bos_token, "eos_token": self.eos_token}
        context.update(extra or {})
        context["messages"] = [dict(m) for m in messages]
        context["add_generation_prompt"] = add_generation_prompt
        try:
            return self._template.render(context)
        except TemplateError:
            raise
        except Exception as e:  # any jinja2 or Python error raised while rendering
            raise TemplateError(
                f"chat template error: {type(e).__name__}: {_one_line(str(e))}"
            ) from None
