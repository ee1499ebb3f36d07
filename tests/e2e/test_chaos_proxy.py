"""The chaos tool's TCP proxy (``tools/chaos.py``: the ``net_*`` faults) forwards bytes both ways,
holds them all while a black hole lasts and lets them through once it ends, and resets open
connections on a cut. Each check waits on a socket event, never on the clock."""

from __future__ import annotations

import contextlib
import importlib.util
import socket
import threading
from pathlib import Path

import pytest
from eventually import eventually

spec = importlib.util.spec_from_file_location("chaos", Path(__file__).resolve().parents[2] / "tools/chaos.py")
chaos = importlib.util.module_from_spec(spec)
spec.loader.exec_module(chaos)


@pytest.fixture
def echo():
    """A server echoing every byte back, upper-cased; what it received, per connection."""
    server = socket.create_server(("127.0.0.1", 0))
    seen: list[bytes] = []
    got = threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn, contextlib.suppress(ConnectionResetError):  # a cut resets this side too
            while data := conn.recv(1024):
                seen.append(data)
                got.set()
                conn.sendall(data.upper())

    def accept() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    yield server.getsockname()[1], seen, got
    server.close()


def _connect(proxy: chaos.Proxy) -> socket.socket:
    port = int(proxy.url.rsplit(":", 1)[1])
    return socket.create_connection(("127.0.0.1", port), timeout=30)


def _recv(s: socket.socket, n: int) -> bytes:
    """``n`` bytes (TCP may hand them over in pieces), fewer only at the end of the stream."""
    out = b""
    while len(out) < n and (chunk := s.recv(n - len(out))):
        out += chunk
    return out


def _round_trip(s: socket.socket, data: bytes) -> None:
    s.sendall(data)
    assert _recv(s, len(data)) == data.upper()


def test_bytes_pass_both_ways_and_the_end_of_stream_too(echo):
    port, seen, _ = echo
    proxy = chaos.Proxy("127.0.0.1", port)
    with _connect(proxy) as s:
        _round_trip(s, b"hello")
        s.shutdown(socket.SHUT_WR)
        assert s.recv(1024) == b""  # the server saw the end and closed: passed back
    assert seen == [b"hello"]


def test_a_black_hole_holds_every_byte_until_it_ends(echo):
    port, seen, got = echo
    proxy = chaos.Proxy("127.0.0.1", port)
    with _connect(proxy) as s:
        _round_trip(s, b"a")
        got.clear()
        proxy.fault("hole", 3600)
        s.sendall(b"held")
        assert not got.wait(0.5), "a byte went through the black hole"
        assert seen == [b"a"]
        proxy.until = 0.0  # the fault ends: what was held goes on
        assert _recv(s, 4) == b"HELD"
    assert seen == [b"a", b"held"]


def test_a_cut_resets_open_connections_and_refuses_new_ones_while_it_lasts(echo):
    port, _, _ = echo
    proxy = chaos.Proxy("127.0.0.1", port)
    s = _connect(proxy)
    _round_trip(s, b"x")
    proxy.fault("cut", 3600)
    with pytest.raises(ConnectionError):
        s.sendall(b"y")
        s.recv(1024)
    s.close()
    with pytest.raises(ConnectionError), _connect(proxy) as t:  # reset at connect, send or recv
        t.sendall(b"z")
        t.recv(1024)
    proxy.until = 0.0
    with _connect(proxy) as u:
        _round_trip(u, b"after")


def test_finished_connections_are_closed(echo):
    """A proxy carries every connection of a long run: each one's sockets are closed once both
    directions end (the first 30-minute run ran out of descriptors at 20000)."""
    port, _, _ = echo
    proxy = chaos.Proxy("127.0.0.1", port)
    for _ in range(50):
        with _connect(proxy) as s:
            _round_trip(s, b"q")
            s.shutdown(socket.SHUT_WR)
            assert s.recv(1024) == b""
    assert eventually(lambda: len(proxy.conns), lambda n: n == 0) == 0
