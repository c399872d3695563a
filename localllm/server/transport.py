"""Where `serve` listens: a Unix socket (mode 0600, by default in a private directory of the
user's runtime directory) and optionally loopback TCP.

A server holds an exclusive lock on `SOCKET.lock` for as long as it runs, so a second server
asked for the same socket fails at once (naming the pid that holds it) and never takes a live
server's socket; a socket file left by a server that died (nothing holds the lock, nothing
accepts connections on it) is replaced.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import ipaddress
import logging
import os
import socket
import stat
import warnings
from pathlib import Path
from typing import NamedTuple

from localllm.errors import LocalLLMError

log = logging.getLogger("localllm.serve")
SOCKET_NAME = "localllm.sock"


class ServeError(LocalLLMError):
    """The server cannot listen where it was asked to."""


def default_socket_path() -> Path:
    """`localllm.sock` in the platformdirs runtime directory (`$XDG_RUNTIME_DIR/localllm`;
    without XDG_RUNTIME_DIR, platformdirs' fallback under /tmp)."""
    from platformdirs import user_runtime_dir

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # platformdirs warns when it falls back to /tmp
        return Path(user_runtime_dir("localllm")) / SOCKET_NAME


def private_dir(path: Path) -> None:
    """Create `path` (and missing parents) mode 0700; refuse one that someone else owns or
    others may enter."""
    for d in (path.parent, path):
        with contextlib.suppress(FileExistsError):
            d.mkdir(mode=0o700, parents=True)
    for d in (path.parent, path):
        st = os.lstat(d)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            raise ServeError(f"{d} is not a directory of yours; choose another --socket")
    if os.lstat(path).st_mode & 0o077:
        os.chmod(path, 0o700)


class Listener(NamedTuple):
    sock: socket.socket
    where: str  # for the startup line: unix:PATH or http://HOST:PORT


class UnixSocket:
    """The socket file and its lock; `close` removes the file (if it is still ours)."""

    def __init__(self, path: Path, default_dir: bool) -> None:
        self.path = path
        if default_dir:
            private_dir(path.parent)
        else:
            with contextlib.suppress(FileExistsError):
                path.parent.mkdir(mode=0o700, parents=True)
        self._lock_fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._lock_fd, 32, 0).decode(errors="replace").strip()
            os.close(self._lock_fd)
            raise ServeError(f"another localllm serve (pid {holder or '?'}) is listening on "
                             f"{path}; stop it or choose another --socket") from None
        os.ftruncate(self._lock_fd, 0)
        os.pwrite(self._lock_fd, str(os.getpid()).encode(), 0)
        try:
            self._replace_stale()
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            old = os.umask(0o177)
            try:
                self.sock.bind(str(path))
            finally:
                os.umask(old)
            os.chmod(path, 0o600)
            self._inode = os.stat(path).st_ino
        except BaseException:
            os.close(self._lock_fd)
            raise

    def _replace_stale(self) -> None:
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise ServeError(f"{self.path} exists and is not a socket; remove it or choose "
                             f"another --socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(1.0)
        try:
            probe.connect(str(self.path))
        except OSError as e:
            if e.errno not in (errno.ECONNREFUSED, errno.ENOENT):
                raise ServeError(f"{self.path}: cannot tell whether a server listens on it "
                                 f"({e.strerror}); choose another --socket") from None
            log.info("replacing %s, left by a server that is gone", self.path)
            self.path.unlink(missing_ok=True)
            return
        finally:
            probe.close()
        raise ServeError(f"a server is already listening on {self.path}; stop it or choose "
                         f"another --socket")

    @property
    def listener(self) -> Listener:
        return Listener(self.sock, f"unix:{self.path}")

    def close(self) -> None:
        self.sock.close()
        with contextlib.suppress(FileNotFoundError):
            if os.stat(self.path).st_ino == self._inode:
                self.path.unlink()
        os.close(self._lock_fd)


def tcp_listener(host: str, port: int, allow_remote: bool) -> Listener:
    """A TCP socket bound to `host:port`; a host that is not loopback needs `allow_remote`."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ServeError(f"cannot resolve --host {host}: {e.strerror}") from None
    family, _, proto, _, addr = infos[0]
    ip = ipaddress.ip_address(addr[0])
    if not ip.is_loopback and not allow_remote:
        raise ServeError(f"--host {host} ({ip}) is not a loopback address: the API would be "
                         f"reachable from the network; pass --allow-remote to do that anyway")
    # NOTE: proto must be IPPROTO_TCP: asyncio turns Nagle's algorithm off (TCP_NODELAY) only
    # on connections of such sockets, and with it on each streamed chunk after the first
    # waits for the client's delayed ACK (40 ms)
    sock = socket.socket(family, socket.SOCK_STREAM, proto or socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise ServeError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    bound = sock.getsockname()
    shown = f"[{bound[0]}]" if family == socket.AF_INET6 else bound[0]
    return Listener(sock, f"http://{shown}:{bound[1]}")
