"""`localllm chat`: a chat REPL over a `Client` (the in-process engine, or `--endpoint`).

The whole session runs on one `asyncio.Runner`: the client, every prompt and every reply live
on its loop. A reply is one `runner.run(...)`, so Ctrl-C cancels it (its stream aborts the
request), the part shown is kept, and the REPL goes on. Replies go to stdout and nothing else
does: the banner, notes and stats go to stderr, so `echo question | localllm chat` prints only
the reply. Conversations are saved after every reply (`chat_store`).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from localllm.apps import chat_commands as commands
from localllm.apps.chat_reply import Reply, ReplyStats
from localllm.apps.chat_store import Conversation, Store, check_name, history_path
from localllm.client import Client, ClientError, ContextOverflow
from localllm.config import SamplingParams
from localllm.errors import LocalLLMError

if TYPE_CHECKING:
    from localllm.apps.connect import LoadFn


def note(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


class ChatSession:
    """The REPL's state: one conversation, its sampling parameters, the last reply's stats."""

    def __init__(self, runner: asyncio.Runner, client: Client, conv: Conversation,
                 params: SamplingParams, store: Store, autosave: bool = True) -> None:
        self.runner, self.client, self.conv = runner, client, conv
        self.params, self.store, self.autosave = params, store, autosave
        self.last: ReplyStats | None = None

    # ------------------------------------------------------------------ replies
    def send(self, text: str) -> None:
        self.conv.messages.append({"role": "user", "content": text})
        self.answer()

    def answer(self) -> None:
        """Reply to the conversation's last (user) message, fitting it into the context."""
        if not self.runner.run(self._fit()):
            return
        while True:
            rep = Reply()
            try:
                self.runner.run(rep.stream(self.client, self.conv.prompt(), self.params))
            except ContextOverflow as e:  # a remote server's word (local: _fit saw to it)
                if rep.parts or not self._drop_oldest(str(e)):
                    self._unanswered(f"the message does not fit the context ({e})")
                    return
                continue
            except KeyboardInterrupt:
                rep.finish = "interrupted"
            except ClientError as e:
                rep.finish, rep.error = "error", str(e)
            break
        text = "".join(rep.parts)
        if text or rep.finish not in ("interrupted", "error"):
            sys.stdout.write("\n")  # a reply, even an empty one, is one line on stdout
        sys.stdout.flush()
        if rep.finish == "interrupted":
            note("[stopped]")
        elif rep.error:
            note(f"[error: {rep.error}]")
        self.last = rep.stats()
        if rep.first is not None:
            note(self.last.line())
        if not text:
            self._unanswered("no reply came" if rep.finish != "interrupted"
                             else "stopped before the reply began")
            return
        msg: dict[str, object] = {"role": "assistant", "content": text}
        if rep.finish in ("interrupted", "error"):
            msg["interrupted"] = True  # cut short: by Ctrl-C or a failure
        self.conv.messages.append(msg)
        self.save()

    def _unanswered(self, why: str) -> None:
        self.conv.pop_turn()
        note(f"[{why}; the message was not kept]")

    async def _fit(self) -> bool:
        """Leave out the oldest turns until the prompt and room for the reply fit the local
        context; False (and the message taken back) when the last message alone is too long."""
        ctx = self.client.context
        n = await self.client.chat_tokens(self.conv.prompt())
        if ctx is None or n is None:
            return True
        room = min(self.params.max_tokens, ctx // 2)
        while n is not None and n + room > ctx:
            if not self._drop_oldest(f"{n:,} prompt tokens + {room:,} for the reply > "
                                     f"{ctx:,}-token context"):
                break
            n = await self.client.chat_tokens(self.conv.prompt())
        if n is not None and n >= ctx:
            self._unanswered(f"the message alone is {n:,} tokens; the context holds {ctx:,}")
            return False
        return True

    def _drop_oldest(self, why: str) -> bool:
        gone = self.conv.drop_oldest_turn()
        if gone:
            note(f"[context full ({why}): the oldest {gone} messages are left out from now "
                 f"on, the system prompt is kept; the saved conversation still has them]")
        return gone > 0

    def save(self) -> None:
        if not self.autosave or not self.conv.messages:
            return
        try:
            self.store.save(self.conv)
        except OSError as e:
            note(f"[cannot save conversations: {e}; saving is off for this session]")
            self.autosave = False

    # ------------------------------------------------------------------ commands
    def command(self, cmd: str, rest: str) -> bool:
        """Run one slash command; False to leave."""
        conv = self.conv
        if cmd == "/exit":
            return False
        if cmd == "/help":
            note(commands.help_text())
        elif cmd == "/reset":
            self._new_conversation(conv.system)
            note("[conversation cleared]")
        elif cmd == "/system":
            if not rest:
                note(f"[system prompt: {conv.system!r}]" if conv.system else
                     "[no system prompt]")
            else:
                self._new_conversation(rest)
                note("[system prompt set; conversation cleared]")
        elif cmd == "/retry":
            while conv.messages and conv.messages[-1]["role"] == "assistant":
                conv.messages.pop()
            if not conv.messages:
                note("[nothing to retry]")
            else:
                self.answer()
        elif cmd == "/undo":
            user = conv.pop_turn()
            note("[nothing to undo]" if user is None else
                 f"[took back: {_preview(user['content'])}]")
            self.save()
        elif cmd == "/set":
            if not rest:
                note(commands.show_params(self.params))
            else:
                self.params = commands.set_param(self.params, rest)
                note(f"[{rest.split()[0]} set]")
        elif cmd in ("/save", "/load", "/list"):
            self._store_command(cmd, rest)
        elif cmd == "/stats":
            note(self.last.table() if self.last else "[no reply yet]")
        else:
            note(f"[unknown command {cmd}: /help lists them]")
        return True

    def _store_command(self, cmd: str, rest: str) -> None:
        if cmd == "/list":
            names = self.store.names()
            note("\n".join(names) if names else "[no saved conversations]")
        elif not rest:
            note(f"[{cmd} needs a NAME]")
        elif cmd == "/save":
            self.conv.name = check_name(rest)
            self.autosave = True
            path = self.store.save(self.conv)
            note(f"[saved as {rest}: {path}]")
        else:
            self.conv = self.store.load(rest)
            note(f"[loaded {rest}: {len(self.conv.messages)} messages]")

    def _new_conversation(self, system: str | None) -> None:
        name = self.store.new_name() if self.autosave else self.conv.name
        self.conv = Conversation(name, system, model=self.conv.model)


def _preview(text: str, n: int = 60) -> str:
    one = " ".join(text.split())
    return repr(one if len(one) <= n else one[:n] + "...")


def start_conversation(args: argparse.Namespace, store: Store) -> Conversation:
    """The conversation `--resume [NAME]` names (the newest without NAME), else a new one."""
    if args.resume is None:
        return Conversation(store.new_name(), args.system)
    name = args.resume
    if not name:
        names = store.names()
        if not names:
            raise LocalLLMError(f"no saved conversation to resume in {store.root}")
        name = names[0]
    conv = store.load(name)
    if args.system:
        conv.system = args.system
    return conv


def run_chat(args: argparse.Namespace, load: LoadFn, params: SamplingParams) -> int:
    """The chat on the model `load` loads, or on --endpoint; the exit status."""
    from localllm.apps.chat_input import PipeInput, TerminalInput
    from localllm.apps.connect import open_client

    store = Store()
    conv = start_conversation(args, store)
    tty = sys.stdin.isatty() and sys.stdout.isatty()
    with asyncio.Runner() as runner:
        client = runner.run(open_client(args, load))
        try:
            conv.model = conv.model or client.card.name
            session = ChatSession(runner, client, conv, params, store, not args.no_save)
            if tty:
                note(f"localllm chat · {client.card.banner()}\n"
                     "/help for commands, Esc-Enter for a new line, Ctrl-D to leave.")
            if args.resume is not None:
                note(f"[resumed {conv.name}: {len(conv.messages)} messages]")
                if tty and conv.messages:
                    last = conv.messages[-1]
                    note(f"[last {last['role']} message: {_preview(last['content'])}]")
            reader = (TerminalInput(runner, history_path(),
                                    store.names) if tty else PipeInput())
            return _loop(session, reader.read)
        finally:
            runner.run(client.aclose())


def _loop(session: ChatSession, read: Callable[[], str]) -> int:
    while True:
        try:
            text = read()
        except EOFError:
            return 0
        if not text.strip():
            continue
        cmd = commands.split_command(text)
        try:
            if cmd is None:
                session.send(text)
            elif not session.command(*cmd):
                return 0
        except (LocalLLMError, OSError) as e:  # a bad command, /save on a full disk
            note(f"[{e}]")
        except KeyboardInterrupt:
            note("[stopped]")
