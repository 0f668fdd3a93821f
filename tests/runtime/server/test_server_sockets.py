"""The Unix socket's rules: mode 0600 (0660 with a group), live servers refused, stale sockets replaced,
symlinks and other files never followed or removed, and only our own socket removed at exit."""

from __future__ import annotations

import grp
import os
import socket
import stat

import httpx
import pytest
from server_helpers import serve, short_tmpdir

from ignis.runtime.server.sockets import (
    SocketError,
    bind_unix_socket,
    check_unix_socket_path,
    remove_unix_socket,
)


def test_socket_mode_0600_and_removed_on_exit() -> None:
    with serve() as running:
        st = os.lstat(running.socket)
        assert stat.S_ISSOCK(st.st_mode)
        assert stat.S_IMODE(st.st_mode) == 0o600
    assert not os.path.lexists(running.socket)


def test_socket_group_gives_0660() -> None:
    group = grp.getgrgid(os.getgid()).gr_name
    folder = short_tmpdir()
    bound = bind_unix_socket(folder / "s.sock", group=group)
    try:
        st = os.lstat(bound.path)
        assert stat.S_IMODE(st.st_mode) == 0o660
        assert st.st_gid == os.getgid()
    finally:
        assert remove_unix_socket(bound)


def test_unknown_group_is_refused() -> None:
    with pytest.raises(SocketError, match="unknown group"):
        bind_unix_socket(short_tmpdir() / "s.sock", group="no-such-group-ignis")


def test_live_server_is_refused() -> None:
    with serve() as running:
        with pytest.raises(SocketError, match="live server"):
            check_unix_socket_path(running.socket)
        with pytest.raises(SocketError, match="live server"):
            bind_unix_socket(running.socket)
        with running.client() as client:  # and it still serves
            assert client.get("/health").status_code == 200


def test_stale_socket_is_replaced() -> None:
    path = short_tmpdir() / "s.sock"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(path))
    dead.close()  # the file stays, nobody listens: stale
    assert check_unix_socket_path(path) is True
    bound = bind_unix_socket(path)
    try:
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.connect(str(path))  # ours now
        client.close()
    finally:
        remove_unix_socket(bound)


def test_symlink_is_never_followed() -> None:
    folder = short_tmpdir()
    target = folder / "target.txt"
    target.write_text("precious")
    link = folder / "s.sock"
    link.symlink_to(target)
    with pytest.raises(SocketError, match="symlink"):
        bind_unix_socket(link)
    assert target.read_text() == "precious" and link.is_symlink()
    dangling = folder / "d.sock"
    dangling.symlink_to(folder / "nowhere.sock")
    with pytest.raises(SocketError, match="symlink"):
        bind_unix_socket(dangling)
    assert not (folder / "nowhere.sock").exists()


def test_regular_file_and_missing_folder_are_refused() -> None:
    folder = short_tmpdir()
    f = folder / "s.sock"
    f.write_text("not a socket")
    with pytest.raises(SocketError, match="not a socket"):
        bind_unix_socket(f)
    assert f.read_text() == "not a socket"
    with pytest.raises(SocketError, match="does not exist"):
        bind_unix_socket(folder / "missing" / "s.sock")


def test_remove_leaves_a_socket_another_server_created() -> None:
    path = short_tmpdir() / "s.sock"
    first = bind_unix_socket(path)
    os.unlink(path)
    second = bind_unix_socket(path)  # another server took the path
    try:
        assert remove_unix_socket(first) is False
        assert os.path.lexists(path)
    finally:
        assert remove_unix_socket(second) is True


def test_tcp_listener_beside_the_socket() -> None:
    with serve(port=0) as running:
        address = running.server.tcp_address
        assert address is not None and address[0] == "127.0.0.1" and address[1] > 0
        with httpx.Client(base_url=f"http://{address[0]}:{address[1]}") as tcp:
            assert tcp.get("/health").status_code == 200
            r = tcp.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 3, "temperature": 0})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3
        with running.client() as uds:
            assert uds.get("/health").status_code == 200
