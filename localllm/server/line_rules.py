"""llama-server's two stop rules for code completion, applied to a completion's text as it
streams: `n_indent` (a new line indented less than that many spaces or tabs ends it, the line
cut off: the model has left the block it was asked to complete) and `t_max_predict_ms` (past
that many milliseconds since the first token, the next line break ends it, so that the text
ends with a whole line).
"""

from __future__ import annotations

import time
from dataclasses import dataclass


def _shallow_line(text: str, n_indent: int, start: int) -> int | None:
    """Where the first line after `start` that ends the completion begins (a line whose first
    character other than space or tab comes before column `n_indent`; an empty line counts), or
    None. A line still all spaces and tabs cannot be told yet."""
    pos = text.find("\n", start)
    while pos != -1:
        line = pos + 1
        i = line
        while i < len(text) and text[i] in " \t":
            i += 1
        if i < len(text) and i - line < n_indent:
            return line
        pos = text.find("\n", line)
    return None


@dataclass
class LineRules:
    n_indent: int = 0  # 0: off
    t_max_predict_ms: int = 0  # 0: off
    text: str = ""  # the completion so far, cut where a rule ended it
    released: int = 0  # characters of `text` handed out
    stopped: bool = False  # a rule ended the completion
    first_token: float | None = None

    def feed(self, piece: str, now: float | None = None) -> str:
        """Text that can be handed out after `piece`; sets `stopped` when a rule ends here."""
        if self.stopped:
            return ""
        now = time.perf_counter() if now is None else now
        if self.first_token is None:
            self.first_token = now
        start = self.text.rfind("\n") if self.text else -1
        self.text += piece
        if self.n_indent > 0:
            cut = _shallow_line(self.text, self.n_indent, max(start, 0))
            if cut is not None:
                self.text = self.text[:cut]
                self.stopped = True
        late = (self.t_max_predict_ms > 0
                and (now - self.first_token) * 1000 > self.t_max_predict_ms)
        if late and not self.stopped and "\n" in piece:  # ends at a line break past the time
            self.text = self.text[:len(self.text) - len(piece) + piece.rindex("\n") + 1]
            self.stopped = True
        return self._release()

    def finish(self) -> str:
        """The text held back, at the completion's end."""
        self.stopped = True
        return self._release()

    def _release(self) -> str:
        end = len(self.text)
        if not self.stopped and self.n_indent > 0:
            last = self.text.rfind("\n")
            # a started line whose indentation is still undecided waits
            if last != -1 and not self.text[last + 1:].strip(" \t"):
                end = last + 1
        out = self.text[self.released:end]
        self.released = end
        return out
