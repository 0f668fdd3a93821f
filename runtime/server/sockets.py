"""Listening sockets: the Unix socket (mode 0600, or 0660 with a group) and an optional TCP socket.

Unix socket rules:

- The path is checked with `lstat`, never followed: a symlink there is refused (whatever it points
  to), and so is any other kind of file (a regular file or a directory is never removed).
- A socket file there is probed with `connect`: a live server answering on it is refused; a stale one
  (connection refused: its server died) is removed and replaced.
- `bind` creates the file under a umask that gives it mode 0600 (0660 with `group`, whose gid is then
  set with `lchown`), so it is never reachable by others, not even for an instant. `bind` does not
  follow a symlink either: one planted between the check and the bind makes it fail (EADDRINUSE).
- `listen` follows at once, so a second server probing the path sees a live server from then on.
- `remove_unix_socket` unlinks the path only while it is still the same file (device and inode), so a
  server never removes a socket that another server created after it.
"""

from __future__ import annotations

import contextlib
import errno
import grp
import ipaddress
import os
import socket
import stat
import threading
from dataclasses import dataclass
from pathlib import Path

from ignis.runtime.errors import IgnisRuntimeError

__all__ = [
    "BoundUnixSocket",
    "SocketError",
    "bind_tcp_socket",
    "bind_unix_socket",
    "check_socket_group",
    "check_tcp_address",
    "check_unix_socket_path",
    "remove_unix_socket",
]

_umask_lock = threading.Lock()
_BACKLOG = 2048


class SocketError(IgnisRuntimeError):
    """The socket cannot be created: the path is held by a live server, is a symlink or another kind
    of file, its folder is missing, the group is unknown, or the address is taken."""


@dataclass(frozen=True)
class BoundUnixSocket:
    """A bound, listening Unix socket.

    Attributes:
        sock: the socket.
        path: its filesystem path.
        dev: st_dev of the socket file at creation.
        ino: st_ino of the socket file at creation.
    """

    sock: socket.socket
    path: Path
    dev: int
    ino: int


def _is_live(path: Path, timeout: float = 1.0) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(timeout)
    try:
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except TimeoutError:
        return True  # a server that accepts slowly is still a server
    except OSError as exc:
        if exc.errno in (errno.ECONNREFUSED, errno.ENOENT):
            return False
        raise SocketError(f"cannot probe the existing socket {path}: {exc}") from exc
    else:
        return True
    finally:
        probe.close()


def _gid(group: str) -> int:
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        if group.isdigit():
            return int(group)
        raise SocketError(f"unknown group {group!r} for --socket-group") from None


def check_socket_group(group: str) -> int:
    """The gid of `--socket-group` (a group name, or a numeric gid), checked before a model loads.

    Raises:
        SocketError: the group is unknown.
    """
    return _gid(group)


def check_tcp_address(host: str, port: int) -> bool:
    """Check, before a model loads, that host:port resolves and can be bound now (the probe socket is
    closed again; port 0 is only resolved). Returns True when the address is a loopback address.

    Raises:
        SocketError: the host does not resolve, or the address cannot be bound (taken, not this host's).
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise SocketError(f"cannot resolve --host {host!r}: {exc}") from exc
    family, kind, proto, _, addr = infos[0]
    if port:
        probe = socket.socket(family, kind, proto)
        try:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(addr)
        except OSError as exc:
            raise SocketError(f"cannot listen on {host}:{port}: {exc}") from exc
        finally:
            probe.close()
    try:
        return ipaddress.ip_address(str(addr[0]).split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def check_unix_socket_path(path: str | os.PathLike[str]) -> bool:
    """Check that a server may create its socket at `path`, changing nothing.

    Returns:
        True when a stale socket is there (it will be replaced), False when the path is free.

    Raises:
        SocketError: the folder is missing, the path is too long, a symlink, not a socket, or held by
            a live server.
    """
    p = Path(path)
    if not p.parent.is_dir():
        raise SocketError(f"the socket's folder {p.parent} does not exist; create it first")
    if len(os.fsencode(p)) >= 108:
        raise SocketError(
            f"socket path {p} is too long ({len(os.fsencode(p))} bytes; a Unix socket takes < 108)"
        )
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        return False
    if stat.S_ISLNK(st.st_mode):
        raise SocketError(f"{p} is a symlink; refusing to follow it (remove it or pick another --socket)")
    if not stat.S_ISSOCK(st.st_mode):
        raise SocketError(f"{p} exists and is not a socket; refusing to replace it")
    if _is_live(p):
        raise SocketError(f"{p} is held by a live server; stop it or pick another --socket")
    return True


def bind_unix_socket(path: str | os.PathLike[str], *, group: str | None = None) -> BoundUnixSocket:
    """Create the server's Unix socket at `path` (module docstring for the rules).

    Args:
        path: the socket path; its folder must exist.
        group: a group name (or numeric gid) for mode 0660; None for mode 0600.

    Raises:
        SocketError: a live server holds the path, the path is a symlink or not a socket, the folder
            is missing, the group is unknown, or the path is too long for a Unix socket.
    """
    p = Path(path)
    gid = _gid(group) if group is not None else None
    if check_unix_socket_path(p):
        try:
            os.unlink(p)  # stale: its server is gone
        except FileNotFoundError:
            pass
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    created = False
    try:
        with _umask_lock:
            old = os.umask(0o117 if gid is not None else 0o177)
            try:
                sock.bind(str(p))
                created = True
            finally:
                os.umask(old)
        sock.listen(_BACKLOG)
        st = os.lstat(p)
        if gid is not None:
            os.chown(p, -1, gid, follow_symlinks=False)  # bind made it 0660 already (umask 0117)
    except OSError as exc:
        sock.close()
        if created:
            with contextlib.suppress(OSError):
                os.unlink(p)
        if exc.errno == errno.EADDRINUSE:
            raise SocketError(
                f"{p} appeared while starting (another server?); refusing to replace it"
            ) from exc
        raise SocketError(f"cannot create the socket {p}: {exc}") from exc
    sock.setblocking(False)
    return BoundUnixSocket(sock=sock, path=p, dev=st.st_dev, ino=st.st_ino)


def remove_unix_socket(bound: BoundUnixSocket) -> bool:
    """Close the socket and unlink its path if it is still the file this server created.

    Returns:
        True when the path was removed.
    """
    bound.sock.close()
    try:
        st = os.lstat(bound.path)
    except FileNotFoundError:
        return False
    if (st.st_dev, st.st_ino) != (bound.dev, bound.ino) or not stat.S_ISSOCK(st.st_mode):
        return False
    try:
        os.unlink(bound.path)
    except FileNotFoundError:
        return False
    return True


def bind_tcp_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0 picks a free one).

    Raises:
        SocketError: the address cannot be bound (taken, or not an address of this host).
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise SocketError(f"cannot resolve --host {host!r}: {exc}") from exc
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(_BACKLOG)
    except OSError as exc:
        sock.close()
        raise SocketError(f"cannot listen on {host}:{port}: {exc}") from exc
    sock.setblocking(False)
    return sock
