"""Live `localllm serve` processes for tests, and clients bound to their Unix socket.

`ServeProcess.start` runs `python -m localllm.apps.cli serve ...` in a child process, reads its
stderr on a thread, and returns once the "ready" line is there (or fails with the output so
far). `stop` sends SIGTERM and waits. Every wait here is bounded.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

READY_TIMEOUT = 60.0
KEY = "test-key-0123456789"  # the API key of the shared test servers



def interruptible() -> None:
    """A child's `preexec_fn`: SIGINT back to its default, so that the CLI under test turns
    Ctrl-C into KeyboardInterrupt even where the test run ignores SIGINT (a shell starts a
    background job that way, and its children inherit it)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)

class ServeProcess:
    def __init__(self, proc: subprocess.Popen[str], socket: Path | None) -> None:
        self.proc = proc
        self.socket = socket
        self.lines: list[str] = []
        self.port: int | None = None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    @classmethod
    def start(cls, args: Sequence[str], socket: Path | None, env: dict[str, str] | None = None,
              wait_ready: bool = True) -> ServeProcess:
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        full_env.pop("LOCALLLM_MODEL", None)
        cmd = [sys.executable, "-m", "localllm.apps.cli", "serve", *args]
        if socket is not None:
            cmd += ["--socket", str(socket)]
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, env=full_env,
                                preexec_fn=interruptible)
        server = cls(proc, socket)
        if wait_ready:
            server.wait_for("ready", READY_TIMEOUT)
            m = re.search(r"listening on http://[^:]+:(\d+)", server.output)
            server.port = int(m.group(1)) if m else None
        return server

    def wait_for(self, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.output:
            if self.proc.poll() is not None:
                time.sleep(0.2)  # let the reader catch the last lines
                raise AssertionError(f"serve exited with {self.proc.returncode}:\n{self.output}")
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"no {text!r} from serve after {timeout} s:\n{self.output}")
            time.sleep(0.05)

    def wait(self, timeout: float = 30.0) -> int:
        """The exit code, once the process has ended and its output is all read."""
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"serve did not stop within {timeout} s:\n{self.output}"
                                 ) from None
        self._reader.join(10)
        return rc

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    # ------------------------------------------------------------------ clients
    def http(self, timeout: float = 30.0) -> httpx.Client:
        """An httpx client on the Unix socket."""
        assert self.socket is not None
        return httpx.Client(transport=httpx.HTTPTransport(uds=str(self.socket)),
                            base_url="http://localllm", timeout=timeout)

    def tcp(self, key: str | None, timeout: float = 30.0) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=f"http://127.0.0.1:{self.port}", headers=headers,
                            timeout=timeout)

    def openai(self, async_: bool = False) -> Any:
        """The official `openai` client on the Unix socket (its httpx transport with `uds`)."""
        import openai

        transport_mod = _openai_httpx()
        if async_:
            http_client = openai.DefaultAsyncHttpxClient(
                transport=transport_mod.AsyncHTTPTransport(uds=str(self.socket)))
            return openai.AsyncOpenAI(base_url="http://localllm/v1", api_key="unused",
                                      http_client=http_client, max_retries=0)
        http_client = openai.DefaultHttpxClient(
            transport=transport_mod.HTTPTransport(uds=str(self.socket)))
        return openai.OpenAI(base_url="http://localllm/v1", api_key="unused",
                             http_client=http_client, max_retries=0)

    def metrics(self) -> dict[str, float]:
        """The server's /metrics as {sample name with labels: value}."""
        with self.http() as c:
            text = c.get("/metrics").text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out


def _openai_httpx() -> Any:
    """The httpx module the installed openai client is built on (httpx2 from openai 3 on)."""
    import openai

    if int(openai.__version__.split(".")[0]) >= 3:
        import httpx2

        return httpx2
    return httpx
