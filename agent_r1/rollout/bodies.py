"""Request bodies checked field by field, and the middleware every HTTP service of the project
shares: a bad request is a 400 naming the field and what was expected, never a 500.

``need(body, key, kind)`` reads one field: ``kind`` is one of ``KINDS`` (``"int"`` refuses JSON
booleans and floats, ``"port"`` is an int in 0..65535, ``"number"`` is finite, lists are checked
item by item). ``service_errors(shape)`` turns ``BadRequest`` raised anywhere in a handler into a
400 in the service's own error shape and any other exception into a logged traceback and a 500 that
says only that it is the server's fault.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

from aiohttp import web

from agent_r1.rollout.sampling import BadRequest

log = logging.getLogger("agent_r1.http")

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
