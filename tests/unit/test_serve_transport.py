"""Where `serve` listens: the Unix socket's mode, its lock against a second server, the stale
and live socket cases, and the loopback check for TCP (no model, no HTTP)."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import pytest

from localllm.server.transport import ServeError, UnixSocket, private_dir, tcp_listener


def test_socket_is_private_and_removed_on_close(tmp_path: Path) -> None:
    path = tmp_path / "run" / "localllm" / "s.sock"
    s = UnixSocket(path, default_dir=True)
    try:
        assert stat.S_ISSOCK(os.lstat(path).st_mode)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
        assert s.listener.where == f"unix:{path}"
    finally:
        s.close()
    assert not path.exists()


def test_second_server_on_the_same_socket_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "s.sock"
    first = UnixSocket(path, default_dir=False)
    try:
        with pytest.raises(ServeError, match=rf"another localllm serve \(pid {os.getpid()}\)"):
            UnixSocket(path, default_dir=False)
        assert stat.S_ISSOCK(os.lstat(path).st_mode)  # the live server's socket is untouched
    finally:
        first.close()
    UnixSocket(path, default_dir=False).close()  # free again once the first one is gone


def test_stale_socket_is_replaced(tmp_path: Path) -> None:
    path = tmp_path / "s.sock"
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(str(path))
    dead.close()  # the file stays, nobody listens
    os.chmod(path, 0o755)
    s = UnixSocket(path, default_dir=False)
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        s.sock.listen()
        probe = socket.socket(socket.AF_UNIX)
        probe.connect(str(path))  # the new socket answers
        probe.close()
    finally:
        s.close()


def test_a_listening_socket_without_the_lock_is_not_taken(tmp_path: Path) -> None:
    path = tmp_path / "s.sock"
    other = socket.socket(socket.AF_UNIX)
    other.bind(str(path))
    other.listen()
    try:
        with pytest.raises(ServeError, match="a server is already listening"):
            UnixSocket(path, default_dir=False)
        probe = socket.socket(socket.AF_UNIX)
        probe.connect(str(path))  # still that server's
        probe.close()
    finally:
        other.close()


def test_a_regular_file_is_not_replaced(tmp_path: Path) -> None:
    path = tmp_path / "s.sock"
    path.write_text("data")
    with pytest.raises(ServeError, match="is not a socket"):
        UnixSocket(path, default_dir=False)
    assert path.read_text() == "data"


def test_private_dir_tightens_a_dir_of_ours(tmp_path: Path) -> None:
    d = tmp_path / "a" / "b"
    d.mkdir(parents=True, mode=0o755)
    os.chmod(d, 0o755)
    private_dir(d)
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    f = tmp_path / "file"
    f.write_text("")
    with pytest.raises(ServeError, match="not a directory of yours"):
        private_dir(f)


def test_tcp_only_on_loopback_unless_allowed(tmp_path: Path) -> None:
    lst = tcp_listener("127.0.0.1", 0, allow_remote=False)
    try:
        assert lst.where.startswith("http://127.0.0.1:") and not lst.where.endswith(":0")
    finally:
        lst.sock.close()
    with pytest.raises(ServeError, match="not a loopback address.*--allow-remote"):
        tcp_listener("0.0.0.0", 0, allow_remote=False)
    busy = tcp_listener("127.0.0.1", 0, allow_remote=False)
    busy.sock.listen()
    port = busy.sock.getsockname()[1]
    try:
        with pytest.raises(ServeError, match=f"cannot listen on 127.0.0.1:{port}"):
            tcp_listener("127.0.0.1", port, allow_remote=False)
    finally:
        busy.sock.close()


def test_tcp_connections_send_small_writes_at_once() -> None:
    """asyncio turns Nagle's algorithm off only on IPPROTO_TCP sockets; with it on, every
    streamed chunk after the first waited for the client's delayed ACK (40 ms)."""
    import asyncio

    lst = tcp_listener("127.0.0.1", 0, allow_remote=False)
    nodelay: list[int] = []

    class Probe(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            sock = transport.get_extra_info("socket")
            nodelay.append(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            transport.close()

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(Probe, sock=lst.sock)
        _, writer = await asyncio.open_connection(*lst.sock.getsockname()[:2])
        while not nodelay:
            await asyncio.sleep(0.01)
        writer.close()
        server.close()

    asyncio.run(asyncio.wait_for(main(), 10))
    assert nodelay == [1]
