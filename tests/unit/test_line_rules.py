"""llama-server's code-completion stop rules over streamed text: `n_indent` cuts the first line
indented less (an empty one too) and holds back a line whose indentation is not known yet;
`t_max_predict_ms` ends the text at its first line break once the time is up."""

from __future__ import annotations

import pytest

from localllm.server.line_rules import LineRules


def run(rules: LineRules, pieces: list[str], times: list[float] | None = None) -> list[str]:
    out = []
    for i, p in enumerate(pieces):
        out.append(rules.feed(p, None if times is None else times[i]))
        if rules.stopped:
            break
    else:
        out.append(rules.finish())
    return out


def test_a_shallower_line_ends_the_text_and_is_cut() -> None:
    r = LineRules(n_indent=4)
    got = run(r, ["x = 1\n", "    y ", "= 2\n  ", "  z = 3\n", "w = 4\n", "never"])
    # the first line is the cursor's own and is never checked; "  " waits until "  z" decides
    assert got == ["x = 1\n", "    y ", "= 2\n", "    z = 3\n", ""]
    assert r.stopped and r.text == "x = 1\n    y = 2\n    z = 3\n"


@pytest.mark.parametrize(("pieces", "text"), [
    (["a\n", "\n", "    b"], "a\n"),  # an empty line ends it, as in llama-server
    (["a\n\t\t", "b\n"], "a\n"),  # a tab counts one, like a space
    (["a\n    b\n", "   c"], "a\n    b\n"),
    (["a", "b", "c"], "abc"),
])
def test_cuts(pieces: list[str], text: str) -> None:
    r = LineRules(n_indent=4)
    assert "".join(run(r, pieces)) == text == r.text


def test_off_releases_everything_at_once() -> None:
    r = LineRules()
    assert run(r, ["a\n", "  ", "b\n"]) == ["a\n", "  ", "b\n", ""]


def test_the_time_limit_waits_for_a_line_break() -> None:
    r = LineRules(t_max_predict_ms=100)
    got = run(r, ["a", "b", "c\nd", "e"], times=[0.0, 0.05, 0.2, 0.3])
    assert got == ["a", "b", "c\n"] and r.stopped and r.text == "abc\n"
    r = LineRules(t_max_predict_ms=100)
    assert run(r, ["a", "b", "c"], times=[0.0, 0.5, 0.9]) == ["a", "b", "c", ""]
    r = LineRules(t_max_predict_ms=100)
    assert run(r, ["a\n", "b\n"], times=[0.0, 0.05]) == ["a\n", "b\n", ""]
    # a line break before the time is up does not end a line begun after it
    r = LineRules(t_max_predict_ms=100)
    got = run(r, ["a = 1\n", "b", " = 2", "\nc"], times=[0.0, 0.05, 0.2, 0.3])
    assert got == ["a = 1\n", "b", " = 2", "\n"] and r.text == "a = 1\nb = 2\n"
