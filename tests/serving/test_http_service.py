"""The HTTP kit every server shares (``agent_r1/http_service.py``): connections that never finish a
request are closed (silent ones and slowloris ones sending their headers a byte at a time), while a
request that takes long to answer is never cut."""

from __future__ import annotations

import asyncio
import socket
import threading

from aiohttp import web

from agent_r1.http_service import start_site


class Site:
    """A served app in a thread of its own: ``/health`` at once, ``/slow`` after ``slow_s``."""

    def __init__(self, idle_timeout_s: float, slow_s: float):
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()

        async def slow(_: web.Request) -> web.Response:
            await asyncio.sleep(slow_s)
            return web.Response(text="done")

        async def health(_: web.Request) -> web.Response:
            return web.Response(text="ok")

        async def start() -> None:
            app = web.Application()
            app.router.add_get("/health", health)
            app.router.add_get("/slow", slow)
            self.runner, self.port = await start_site(app, "127.0.0.1", 0, idle_timeout_s=idle_timeout_s)
            ready.set()

        threading.Thread(target=lambda: (self.loop.run_until_complete(start()), self.loop.run_forever()),
                         daemon=True).start()  # fmt: skip
        assert ready.wait(60)

    def connect(self) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", self.port))
        s.settimeout(60)  # a guard far above the timeouts under test
        return s

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)


def _closed(s: socket.socket) -> bool:
    """The server closed the connection without answering (reads end of stream)."""
    try:
        return s.recv(100) == b""
    except ConnectionResetError:
        return True


def test_silent_and_slowloris_connections_are_closed_a_slow_answer_is_not():
    site = Site(idle_timeout_s=1.0, slow_s=3.0)
    try:
        silent = site.connect()
        assert _closed(silent)  # sent nothing: closed after the idle timeout, not held forever
        slowloris = site.connect()
        slowloris.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: ")
        closed = False
        for _ in range(600):  # a byte at a time, never finishing the headers
            try:
                slowloris.sendall(b"a")
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            slowloris.settimeout(0.05)
            try:
                if slowloris.recv(100) == b"":
                    closed = True
                    break
            except TimeoutError:
                pass
        assert closed, "a connection that never finished its headers was kept"
        busy = site.connect()  # a 3 s answer, three times the idle timeout: delivered whole
        busy.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = b""
        while b"done" not in answer:
            chunk = busy.recv(4096)
            assert chunk, f"the server cut a request it was answering: {answer!r}"
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 200")
        for sock in (silent, slowloris, busy):
            sock.close()
    finally:
        site.close()
