"""The HTTP service kit every server of the project shares (the rollout server, the retriever, a
recipe's environment service): strict JSON responses, request bodies checked field by field (a
bad request is a 400 naming the field and what was expected, never a 500), the API key, the site
and its main loop, and the ready file a service publishes its address in.

``need(body, key, kind)`` reads one field: ``kind`` is one of ``KINDS`` (``"int"`` refuses JSON
booleans and floats, ``"port"`` is an int in 0..65535, ``"number"`` is finite, lists are checked
item by item). ``service_errors(shape)`` turns ``BadRequest`` raised anywhere in a handler into a
400 in the service's own error shape and any other exception into a logged traceback and a 500 that
says only that it is the server's fault.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from agent_r1.jsonfiles import atomic_write_json

log = logging.getLogger("agent_r1.http")

PARSE_OFF_LOOP_BYTES = 1 << 20  # larger bodies are parsed in a thread: /health stays responsive
OPEN_PATHS = frozenset({"/health"})  # answered without the API key (liveness probes)


class BadRequest(ValueError):
    """Invalid request input; the message names the field (HTTP 400, or the class's ``status``)."""

    status = 400


class TooLarge(BadRequest):
    """Well formed, but over a limit the server sets (HTTP 413; the message names its flag)."""

    status = 413


MISSING = object()


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


KINDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "str": (lambda v: isinstance(v, str), "a string"),
    "text": (lambda v: isinstance(v, str) and bool(v.strip()), "a non-empty string"),
    "int": (_int, "an integer"),
    "count": (lambda v: _int(v) and v >= 1, "an integer >= 1"),
    "index": (lambda v: _int(v) and v >= 0, "an integer >= 0"),
    "port": (lambda v: _int(v) and 0 < v < 65536, "a port number in 1..65535"),
    "number": (lambda v: (isinstance(v, float) or _int(v)) and math.isfinite(v), "a finite number"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "object": (lambda v: isinstance(v, dict), "an object"),
    "str_list": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of strings"),
    "int_list": (lambda v: isinstance(v, list) and all(_int(x) for x in v), "a list of integers"),
    "shape_list": (
        lambda v: (
            isinstance(v, list) and all(isinstance(s, list) and all(_int(x) and x >= 0 for x in s) for s in v)
        ),
        "a list of shapes (lists of integers >= 0)",
    ),
    "scalar": (
        lambda v: isinstance(v, str | int | float) and not isinstance(v, bool),
        "a string or a number",
    ),
}


def describe(v: Any) -> str:
    text = repr(v)
    return f"{type(v).__name__} {text[:40]}{'...' if len(text) > 40 else ''}"


def need(body: dict[str, Any], key: str, kind: str, default: Any = MISSING, where: str = "") -> Any:
    """``body[key]`` checked to be ``kind``; absent: ``default``, or a BadRequest if there is none.
    ``None`` counts as absent (JSON ``null`` for an optional field)."""
    name = f"{where}{key}"
    v = body.get(key)
    if v is None:
        if default is MISSING:
            raise BadRequest(f"{name}: required ({KINDS[kind][1]})")
        return default
    ok, want = KINDS[kind]
    if not ok(v):
        raise BadRequest(f"{name}: must be {want}, got {describe(v)}")
    return v


def as_object(body: Any, what: str = "request body") -> dict[str, Any]:
    if not isinstance(body, dict):
        raise BadRequest(f"{what} must be a JSON object, got {type(body).__name__}")
    return body


def service_errors(shape: Callable[[str, int], web.Response]):
    """The middleware: ``BadRequest`` -> ``shape(message, 400)``; HTTP errors aiohttp raises on
    purpose pass; anything else is a bug of the server: logged with its traceback, answered with a
    500 that names no internals."""

    @web.middleware
    async def handle(request: web.Request, handler):
        try:
            return await handler(request)
        except web.HTTPException:
            raise
        except BadRequest as e:
            return shape(str(e), 400)
        except Exception:
            log.exception("internal error serving %s %s", request.method, request.path)
            return shape("internal server error (a bug: the server logged it)", 500)

    return handle


__all__ = ["KINDS", "MISSING", "as_object", "describe", "need", "service_errors"]


def _finite(obj: Any) -> Any:
    """``obj`` with every NaN / infinity replaced by None (JSON has no such numbers)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def dumps(obj: Any) -> str:
    """Strict JSON: a non-finite float becomes null instead of the bare ``NaN`` json.dumps writes."""
    try:
        return json.dumps(obj, allow_nan=False)
    except ValueError:
        return json.dumps(_finite(obj), allow_nan=False)


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.json_response(obj, status=status, dumps=dumps)


def error_response(msg: str, status: int = 400) -> web.Response:
    return json_response({"error": {"message": msg}}, status=status)


def lone_surrogate(obj: Any) -> str | None:
    """Where a parsed JSON value holds text that is not Unicode (a lone UTF-16 surrogate, escaped
    as ``\\ud800`` or sent raw: Python's JSON parser lets both through), as ``messages[0].content``
    and what is wrong; None when every string (keys included) is text a tokenizer can take."""
    stack: list[tuple[Any, str]] = [(obj, "")]
    while stack:
        o, where = stack.pop()
        if isinstance(o, str):
            try:
                o.encode("utf-8")
            except UnicodeEncodeError as e:
                code = ord(o[e.start])
                return f"{where or 'body'}: not valid Unicode text (lone surrogate U+{code:04X} at character {e.start})"
        elif isinstance(o, dict):
            for k, v in o.items():
                at = f"{where}.{str(k).encode('utf-8', 'backslashreplace').decode()}".lstrip(".")
                stack.append((k, f"{at} (a key)"))
                if isinstance(v, str | dict | list):
                    stack.append((v, at))
        elif isinstance(o, list):
            stack.extend((v, f"{where}[{i}]") for i, v in enumerate(o) if isinstance(v, str | dict | list))
    return None


# what a lone surrogate looks like in a raw body: escaped (\ud800-\udfff) or as UTF-8 bytes
# (0xED 0xA0-0xBF); a body without either cannot hold one, and skips the walk over every value
_SURROGATE_BYTES = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


def _parse(raw: bytes) -> Any:
    body = json.loads(raw)
    bad = lone_surrogate(body) if _SURROGATE_BYTES.search(raw) else None
    if bad is not None:
        raise BadRequest(bad)
    return body


async def read_json_body(request: web.Request) -> Any:
    """The request body as JSON; BadRequest naming what is wrong (not JSON, not UTF-8, text with a
    lone surrogate: the field named). Bodies over ``client_max_size`` are refused by aiohttp with
    413 before they are read; large ones are parsed and checked off the event loop."""
    raw = await request.read()
    try:
        if len(raw) > PARSE_OFF_LOOP_BYTES:
            return await asyncio.to_thread(_parse, raw)
        return _parse(raw)
    except UnicodeDecodeError as e:
        raise BadRequest(f"request body is not UTF-8: {e}") from None
    except json.JSONDecodeError as e:
        raise BadRequest(f"request body is not JSON: {e}") from None
    except RecursionError:
        raise BadRequest("request body is nested too deeply") from None


def api_key_middleware(key: str):
    """SGLang's ``--api-key``: every endpoint but ``/health`` needs ``Authorization: Bearer KEY``."""
    expected = f"Bearer {key}".encode()

    @web.middleware
    async def check(request: web.Request, handler):
        if request.path not in OPEN_PATHS:
            # the header's bytes as sent (aiohttp keeps undecodable ones as surrogates): a key with
            # bytes outside ASCII is a wrong key (401), never an encoding error (500, a traceback)
            given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
            if not hmac.compare_digest(given, expected):
                return error_response(
                    "unauthorized: this server needs its API key (Authorization: Bearer ...)", 401
                )
        return await handler(request)

    return check


MAX_CLIENT_REQUESTS = 1024  # requests one client address may have in flight at once


def client_limit(max_inflight: int = MAX_CLIENT_REQUESTS, flag: str = "--max-client-requests"):
    """At most ``max_inflight`` requests in flight from one client address (a 429 naming ``flag``
    beyond it, answered at once); ``/health`` is exempt. What one client can hold of a server is
    then bounded however many connections it opens (idle ones are closed by ``start_site``)."""
    inflight: dict[str, int] = {}

    @web.middleware
    async def limit(request: web.Request, handler):
        if request.path in OPEN_PATHS:
            return await handler(request)
        peer = request.remote or "?"
        n = inflight.get(peer, 0)
        if n >= max_inflight:
            return error_response(
                f"too many requests in flight from {peer}: at most {max_inflight} at once ({flag})", 429
            )
        inflight[peer] = n + 1
        try:
            return await handler(request)
        finally:
            inflight[peer] -= 1
            if not inflight[peer]:
                del inflight[peer]

    return limit


# a connection that has not sent a whole request within this long (silent, or a slowloris sending
# its headers byte by byte), or stays idle this long after its last answer, is closed. Longer than
# the clients' own keep-alive (aiohttp's 15 s), so a client never reuses a connection being closed
IDLE_TIMEOUT_S = 30.0


MAX_HEADER_BYTES = 8190  # the request line and each header (aiohttp's default); longer ones: a 400


async def start_site(
    app: web.Application,
    host: str,
    port: int,
    idle_timeout_s: float = IDLE_TIMEOUT_S,
    max_header_bytes: int = MAX_HEADER_BYTES,
) -> tuple[web.AppRunner, int]:
    """Serve ``app`` on ``host:port`` (0 = a free port); returns the runner and the bound port.
    handler_cancellation: a client that hangs up cancels its handler, which aborts its work.
    ``idle_timeout_s``: the header and idle timeout (a request being handled is never cut);
    ``max_header_bytes``: the longest request line or header (a 400 saying the limit beyond it)."""
    runner = web.AppRunner(
        app,
        access_log=None,
        handler_cancellation=True,
        keepalive_timeout=idle_timeout_s,
        max_line_size=max_header_bytes,
        max_field_size=max_header_bytes,
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    if port == 0:
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, port


def serve_until_stopped(start: Any, ready_file: str | Path | None = None, stop_when: Any = None) -> int:
    """A service's main loop (retriever, environment servers): ``await start()`` gives (runner,
    url, extra); ``ready_file`` then gets ``{"url", **extra}`` (written atomically); serve until
    SIGTERM / Ctrl-C / ``stop_when()``."""
    import signal

    async def main() -> None:
        runner, url, extra = await start()
        if ready_file:
            write_ready(ready_file, url, **extra)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        while not stop.is_set():
            if stop_when is not None and stop_when():
                log.info("shutdown requested: stopping")
                break
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except TimeoutError:
                pass
        await runner.cleanup()

    asyncio.run(main())
    return 0


def http_request(
    method: str, url: str, body: Any = None, timeout: float = 10, api_key: str | None = None
) -> tuple[int, str]:
    """A blocking HTTP call outside an event loop (the router's admin API, tests): the status and
    the text of the answer, an error status included. ``body``: JSON, or bytes sent as they are."""
    import urllib.error
    import urllib.request

    data = None if body is None else body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


# ---- publishing and following addresses: every role and service of a run, the one place ------------


def write_ready(path: str | Path, url: str, **extra: Any) -> None:
    """A service's ready file: ``{"url", **extra}``, written atomically (a reader never sees half)."""
    atomic_write_json(Path(path), {"url": url, **extra})


def read_ready(path: str | Path) -> str | None:
    """The address in a ready file; None while there is none (not yet written, being replaced)."""
    try:
        return json.loads(Path(path).read_text())["url"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def published_urls(folder: Path) -> list[str]:
    """The addresses of every instance publishing in ``folder`` (``NAME_i.json``), in name order;
    one being replaced is left out."""
    return [u for p in sorted(Path(folder).glob("*.json")) if (u := read_ready(p))]


def follow_published(ready_file: Path, timeout_s: float, what: str) -> Callable[[], str]:
    """The address a single service (retriever, router, environment server) published in
    ``ready_file``, as a function read at every use: a restarted service listens on a new port and
    publishes again. Waits up to ``timeout_s`` for the first address; while the service restarts
    (its file gone or being replaced) the last one stands."""
    deadline = time.time() + timeout_s
    while (first := read_ready(ready_file)) is None:
        if time.time() > deadline:
            raise TimeoutError(f"the {what} did not publish {ready_file} within {timeout_s:.0f} s")
        time.sleep(0.1)
    last = [first]

    def current() -> str:
        last[0] = read_ready(ready_file) or last[0]
        return last[0]

    return current
