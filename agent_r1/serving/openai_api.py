"""OpenAI-compatible routes on ``agent-r1 serve``: ``/v1/models``, ``/v1/completions``,
``/v1/chat/completions``.

Chats are rendered by the same ``ChatCodec`` the agents train with (ChatML, Hermes tool schemas in
the system prompt); an assistant message's ``tool_calls`` become ``<tool_call>`` blocks and
consecutive ``tool`` messages one user turn of ``<tool_response>`` blocks, exactly as ``ToolEnv``
writes them. Generated ``<tool_call>`` blocks come back parsed into ``tool_calls``. Sampling goes
to the engine as the ``/generate`` route would send it (``seed`` -> ``sampling_seed``), so a chat
completion's tokens equal ``/generate``'s on the same prompt ids and seed. Bad requests get
OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}`` with status 400.
SGLang serves the same routes, so clients stay engine-neutral.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from agent_r1.agent.chat import ChatCodec, codec_for
from agent_r1.agent.tool_calls import (
    MalformedCall,
    ToolCall,
)
from agent_r1.engines.embedded.server import Server
from agent_r1.http_service import BadRequest, dumps, read_json_body
from agent_r1.vision.images import ImageError


class InvalidRequest(ValueError):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def error_response(message: str, param: str | None = None, status: int = 400) -> web.Response:
    body = {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": None}}
    return web.json_response(body, status=status, dumps=dumps)


def field_of(body: dict[str, Any], key: str, types: tuple[type, ...], default: Any) -> Any:
    """``body[key]`` of one of ``types`` (a JSON true is no number), else ``default`` when absent."""
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, types) or (isinstance(v, bool) and bool not in types):
        names = " or ".join(
            "boolean" if t is bool else "number" if t is float else "integer" if t is int else t.__name__
            for t in types
        )
        raise InvalidRequest(f"{key}: must be a {names}, got {json.dumps(v)}", key)
    return v


def _text(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message's content: a string, or OpenAI's list of ``{"type": "text", "text"}`` and
    ``{"type": "image_url", "image_url": {"url": "data:image/...;base64,..."}}`` parts (text parts
    are joined; with an image the list is kept for the codec, which renders the vision markup)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[dict[str, Any]] = []
        for j, p in enumerate(content):
            if isinstance(p, dict) and p.get("type") == "image_url":
                url = p.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                if not isinstance(url, str):
                    raise InvalidRequest(f"{where}[{j}]: image_url needs a url string", where)
                parts.append({"type": "image_url", "image_url": {"url": url}})
            elif isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str):
                parts.append({"type": "text", "text": p["text"]})
            else:
                raise InvalidRequest(f"{where}[{j}]: a content part is a text or an image_url part", where)
        if all(p["type"] == "text" for p in parts):
            return "".join(p["text"] for p in parts)
        return parts
    raise InvalidRequest(f"{where}: content must be a string or a list of text and image_url parts", where)


def render_messages(messages: Any) -> list[dict[str, Any]]:
    """OpenAI chat messages -> the messages ``ChatCodec.encode_chat`` renders in the model's chat
    format, as training renders them: an assistant's ``tool_calls`` as ``{"name", "arguments"}``,
    a tool message with the name of the call it answers (found by ``tool_call_id``)."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages: must be a non-empty list", "messages")
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # tool_call_id -> function name
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in (
            "system",
            "developer",
            "user",
            "assistant",
            "tool",
        ):
            raise InvalidRequest(f"{where}: needs a role of system, user, assistant or tool", where)
        role = "system" if m["role"] == "developer" else m["role"]
        text = _text(m.get("content"), f"{where}.content")
        if role == "system" and out:
            raise InvalidRequest(f"{where}: a system message must come first", where)
        if role == "tool":
            for key in ("name", "tool_call_id"):
                if m.get(key) is not None and not isinstance(m[key], str):
                    raise InvalidRequest(f"{where}.{key}: must be a string, got {json.dumps(m[key])}", where)
            name = m.get("name") or names.get(m.get("tool_call_id") or "")
            out.append({"role": "tool", "name": name, "content": text})
        elif role == "assistant" and m.get("tool_calls"):
            if not isinstance(m["tool_calls"], list):
                raise InvalidRequest(
                    f"{where}.tool_calls: must be a list, got {json.dumps(m['tool_calls'])}", where
                )
            calls = []
            for j, c in enumerate(m["tool_calls"]):
                if isinstance(c, dict) and c.get("id") is not None and not isinstance(c["id"], str):
                    raise InvalidRequest(f"{where}.tool_calls[{j}].id: must be a string", where)
                f = c.get("function") if isinstance(c, dict) else None
                if not isinstance(f, dict) or not isinstance(f.get("name"), str):
                    raise InvalidRequest(f"{where}.tool_calls[{j}]: needs function.name", where)
                args = f.get("arguments", "{}")
                try:
                    args = json.loads(args) if isinstance(args, str) else args
                except json.JSONDecodeError as e:
                    raise InvalidRequest(
                        f"{where}.tool_calls[{j}].function.arguments: not JSON ({e})", where
                    ) from None
                if not isinstance(args, dict):
                    raise InvalidRequest(
                        f"{where}.tool_calls[{j}].function.arguments: must be an object", where
                    )
                names[c.get("id") or ""] = f["name"]
                calls.append({"name": f["name"], "arguments": args})
            out.append({"role": "assistant", "content": text, "tool_calls": calls})
        else:
            out.append({"role": role, "content": text})
    return out


def tool_schemas(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    tools = body.get("tools")
    choice = body.get("tool_choice", "auto")
    if choice not in ("auto", "none", None):
        raise InvalidRequest(
            f"tool_choice: {json.dumps(choice)} needs constrained decoding, which this engine does not "
            "have; use 'auto' or 'none'",
            "tool_choice",
        )
    if not tools or choice == "none":
        return None
    if not isinstance(tools, list):
        raise InvalidRequest("tools: must be a list", "tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise InvalidRequest(f"tools[{i}]: must be {{'type': 'function', 'function': {{...}}}}", "tools")
        if not isinstance(t["function"].get("name"), str):
            raise InvalidRequest(f"tools[{i}].function.name: must be a string", "tools")
        # rendered as the training prompt renders a tool schema (``BaseTool.schema``): name,
        # description, parameters; ``strict`` is a decoding directive for the API, not shown
        f = t["function"]
        shown = {k: f[k] for k in ("name", "description", "parameters") if k in f}
        out.append({"type": "function", "function": shown})
    return out


def _tool_calls(codec: ChatCodec, text: str) -> tuple[str, list[dict[str, Any]]]:
    """The reply's content and its parsed calls in the model's format; with a malformed call
    the whole text stays content (the client sees what the model wrote)."""
    calls = codec.parse_tool_calls(text)
    if not calls or any(isinstance(c, MalformedCall) for c in calls):
        return text, []
    return codec.content(text), [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)},
        }
        for c in calls
        if isinstance(c, ToolCall)
    ]


def chat_message(codec: ChatCodec, text: str, tools: bool, finish: str) -> tuple[dict[str, Any], str]:
    """A finished reply's ``message`` (content, parsed ``tool_calls`` when the request gave tools)
    and its ``finish_reason`` (``tool_calls`` when it made calls, else ``finish``)."""
    content, calls = _tool_calls(codec, text) if tools else (codec.answer_text(text), [])
    msg: dict[str, Any] = {"role": "assistant", "content": None if calls and not content.strip() else content}
    if calls:
        msg["tool_calls"] = calls
    return msg, "tool_calls" if calls else finish


def token_logprob(tokenizer: Any, t: int, lp: float) -> dict[str, Any]:
    """One entry of a chat choice's ``logprobs.content``: the token's text, logprob and bytes."""
    s = tokenizer.decode([t], skip_special_tokens=False)
    return {"token": s, "logprob": lp, "bytes": list(s.encode())}


def message_chunks(head: dict[str, Any], msg: dict[str, Any], finish: str) -> list[dict[str, Any]]:
    """A finished reply as the ``chat.completion.chunk`` events a stream sends: the role, the
    content, the tool calls (each with its ``index``), the finish reason."""

    def chunk(delta: dict[str, Any], fin: str | None = None) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": fin}
        return {**head, "object": "chat.completion.chunk", "choices": [choice]}

    out = [chunk({"role": "assistant", "content": ""})]
    if msg.get("content"):
        out.append(chunk({"content": msg["content"]}))
    if msg.get("tool_calls"):
        out.append(chunk({"tool_calls": [{**c, "index": k} for k, c in enumerate(msg["tool_calls"])]}))
    return [*out, chunk({}, finish)]


class OpenAIRoutes:
    """Installs the routes on a ``Server``'s app (before it starts)."""

    def __init__(self, server: Server, model_name: str):
        self.server, self.engine, self.name = server, server.engine, model_name
        self.codec: ChatCodec | None = None
        try:
            self.codec = codec_for(self.engine.tokenizer)
            self.codec.vision = self.engine.vision_spec  # a vision model's image geometry (else None)
        except ValueError:
            pass  # no chat format agent-r1 knows: completions only
        r = server.app.router
        r.add_get("/v1/models", self.models)
        r.add_post("/v1/completions", self.completions)
        r.add_post("/v1/chat/completions", self.chat)

    # ---- shared ------------------------------------------------------------------------------------
    def _sampling(self, body: dict[str, Any], max_tokens_default: int, stop_ids: list[int]) -> dict[str, Any]:
        stop = body.get("stop")
        if stop is not None and not isinstance(stop, (str, list)):
            raise InvalidRequest("stop: must be a string or a list of strings", "stop")
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        d = {
            "temperature": field_of(body, "temperature", (int, float), 1.0),
            "top_p": field_of(body, "top_p", (int, float), 1.0),
            "n": field_of(body, "n", (int,), 1),
            "max_new_tokens": max_tokens_default if max_tokens is None else max_tokens,
            "stop": stop,
            "stop_token_ids": stop_ids,
            "sampling_seed": field_of(body, "seed", (int,), None),
        }
        return {k: v for k, v in d.items() if v is not None}

    def _requests(
        self,
        ids: list[int],
        sampling: dict[str, Any],
        top: int,
        images: list[Any] | None = None,
        prompt_field: str = "messages",
    ) -> list[Any]:
        try:
            return self.engine.make_requests(
                ids, sampling, return_logprob=True, top_logprobs_num=top, image_data=images or None
            )
        except BadRequest as e:  # names the field in SGLang's terms: say OpenAI's
            msg = (
                str(e)
                .replace("sampling_params.max_new_tokens", "max_tokens")
                .replace("sampling_params.", "")
                .replace("input_ids:", f"{prompt_field}:")
            )
            raise InvalidRequest(msg, prompt_field if msg.startswith(f"{prompt_field}:") else None) from None

    async def _updates(
        self, reqs: list[Any], every_token: bool = True
    ) -> AsyncIterator[tuple[int, list[int], bool]]:
        """(choice index, output ids so far, finished) as the engine produces tokens;
        ``every_token=False``: at each request's end only (a whole answer waits for it, and waking
        the event loop per token takes GIL time from the engine's scheduler)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        index = {id(r): i for i, r in enumerate(reqs)}
        for r in reqs:
            r.on_update = lambda r, fin: (
                (every_token or fin)
                and loop.call_soon_threadsafe(queue.put_nowait, (index[id(r)], list(r.out_ids), fin))
            )
        self.engine.submit(reqs)
        left = len(reqs)
        try:
            while left:
                i, ids, fin = await queue.get()
                left -= fin
                yield i, ids, fin
        except (asyncio.CancelledError, ConnectionResetError):
            self.engine.abort(rids=[r.rid for r in reqs])  # one pass
            raise

    def _decode(self, ids: list[int], stop_ids: set[int]) -> str:
        while ids and ids[-1] in stop_ids:
            ids = ids[:-1]
        return self.engine.tokenizer.decode(ids, skip_special_tokens=False)

    @staticmethod
    def _finish(r: Any) -> str:
        f = r.finish or {}
        return "length" if f.get("type") == "length" else "stop"  # stop token, stop string, abort

    def _token(self, t: int, lp: float) -> dict[str, Any]:
        return token_logprob(self.engine.tokenizer, t, lp)

    def _usage(self, reqs: list[Any]) -> dict[str, int]:
        p, c = len(reqs[0].prompt), sum(len(r.out_ids) for r in reqs)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    async def _handle(self, request: web.Request, fn) -> web.StreamResponse:
        try:  # bytes, whatever charset the Content-Type claims: JSON is UTF-8
            body = await read_json_body(request)
        except BadRequest as e:
            return error_response(str(e))
        if not isinstance(body, dict):
            return error_response(f"request body must be a JSON object, got {type(body).__name__}")
        try:
            return await fn(request, body)
        except InvalidRequest as e:
            return error_response(str(e), e.param)

    # ---- routes -----------------------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        model = {"id": self.name, "object": "model", "created": 0, "owned_by": "agent-r1"}
        return web.json_response({"object": "list", "data": [model]}, dumps=dumps)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, self._completions)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, self._chat)

    async def _completions(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        prompt = body.get("prompt")
        if (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            ids = list(prompt)
        elif isinstance(prompt, str) and prompt:  # tokenized off the event loop: /health answers meanwhile
            ids = list(
                await asyncio.to_thread(self.engine.tokenizer.encode, prompt, add_special_tokens=False)
            )
        else:
            raise InvalidRequest("prompt: must be a non-empty string or a list of token ids", "prompt")
        top = field_of(body, "logprobs", (int,), 0)
        eos = sorted(self.engine.eos_ids)
        reqs = self._requests(ids, self._sampling(body, 16, []), top, prompt_field="prompt")
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created, "model": self.name}
        if body.get("stream"):
            return await self._sse(request, reqs, lambda i, d, r: {**head, "choices": [
                {"index": i, "text": d, "logprobs": None, "finish_reason": self._finish(r) if r.finish else None}
            ]}, set(eos))  # fmt: skip
        async for _ in self._updates(reqs, every_token=False):
            pass
        choices = []
        for i, r in enumerate(reqs):
            c: dict[str, Any] = {
                "index": i,
                "text": self._decode(r.out_ids, set(eos)),
                "finish_reason": self._finish(r),
                "logprobs": None,
            }
            if "logprobs" in body and body["logprobs"] is not None:
                toks = [self.engine.tokenizer.decode([t]) for t in r.out_ids]
                c["logprobs"] = {
                    "tokens": toks,
                    "token_logprobs": list(r.out_logprobs),
                    "top_logprobs": [
                        {self.engine.tokenizer.decode([t]): lp for lp, t in alts} for alts in r.out_top
                    ]
                    if top
                    else None,
                    "text_offset": [sum(len(x) for x in toks[:k]) for k in range(len(toks))],
                }
            choices.append(c)
        return web.json_response({**head, "choices": choices, "usage": self._usage(reqs)}, dumps=dumps)

    def chat_prompt(self, body: dict[str, Any]) -> tuple[list[int], list[Any]]:
        """The prompt ids of a chat request (what ``/generate`` would be given) and its images."""
        if self.codec is None:
            raise InvalidRequest(
                f"model {self.name} has no ChatML chat template: use /v1/completions", "model"
            )
        try:
            return self.codec.encode_chat_images(render_messages(body.get("messages")), tool_schemas(body))
        except ImageError as e:
            raise InvalidRequest(str(e), "messages") from None

    async def _chat(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        # rendered and tokenized off the event loop (its cost grows with the client's text)
        ids, images = await asyncio.to_thread(self.chat_prompt, body)
        tools = tool_schemas(body) is not None
        want_lp = bool(field_of(body, "logprobs", (bool,), False))
        top = field_of(body, "top_logprobs", (int,), 0)
        if top and not want_lp:
            raise InvalidRequest("top_logprobs: needs logprobs: true", "top_logprobs")
        assert self.codec is not None
        stops = set(self.codec.stop_token_ids)
        # no max_tokens: up to the context length, as OpenAI
        reqs = self._requests(
            ids, self._sampling(body, max(self.engine.max_len - len(ids) - 1, 0), sorted(stops)), top, images
        )
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "created": created, "model": self.name}
        if body.get("stream"):
            return await self._chat_stream(request, reqs, head, tools, stops)
        async for _ in self._updates(reqs, every_token=False):
            pass
        choices = []
        for i, r in enumerate(reqs):
            msg, finish = chat_message(self.codec, self._decode(r.out_ids, stops), tools, self._finish(r))
            c: dict[str, Any] = {"index": i, "message": msg, "finish_reason": finish, "logprobs": None}
            if want_lp:
                c["logprobs"] = {
                    "content": [
                        {
                            **self._token(t, lp),
                            "top_logprobs": [self._token(a, alp) for alp, a in r.out_top[k]] if top else [],
                        }
                        for k, (t, lp) in enumerate(zip(r.out_ids, r.out_logprobs, strict=True))
                    ]
                }
            choices.append(c)
        out = {**head, "object": "chat.completion", "choices": choices, "usage": self._usage(reqs)}
        return web.json_response(out, dumps=dumps)

    # ---- streaming ----------------------------------------------------------------------------------
    async def _start_sse(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        return resp

    async def _sse(self, request, reqs, chunk, stops: set[int]) -> web.StreamResponse:
        resp = await self._start_sse(request)
        sent = [""] * len(reqs)
        async for i, ids, fin in self._updates(reqs):
            text = self._decode(ids, stops)
            if text.endswith("\ufffd") and not fin:
                continue  # half a UTF-8 character: wait for the rest
            delta, sent[i] = text[len(sent[i]) :], text
            if delta or fin:
                await resp.write(f"data: {dumps(chunk(i, delta, reqs[i]))}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _chat_stream(self, request, reqs, head, tools: bool, stops: set[int]) -> web.StreamResponse:
        """Content deltas as tokens come; with tools, text from ``<tool_call>`` on is held back and
        the parsed calls are sent with the last chunk (``finish_reason: tool_calls``)."""
        resp = await self._start_sse(request)
        head = {**head, "object": "chat.completion.chunk"}

        async def send(i: int, delta: dict[str, Any], finish: str | None) -> None:
            c = {**head, "choices": [{"index": i, "delta": delta, "logprobs": None, "finish_reason": finish}]}
            await resp.write(f"data: {dumps(c)}\n\n".encode())

        for i in range(len(reqs)):
            await send(i, {"role": "assistant", "content": ""}, None)
        sent = [""] * len(reqs)
        async for i, ids, fin in self._updates(reqs):
            text = self._decode(ids, stops)
            calls: list[dict[str, Any]] = []
            if tools and fin:
                text, calls = _tool_calls(self.codec, text)
            elif tools:  # never send what may be the start of a tool call
                text = self.codec.content(text, final=False)
            else:
                text = self.codec.answer_text(text)
            if not text.startswith(sent[i]) or (text.endswith("\ufffd") and not fin):
                text = sent[i]  # half a UTF-8 character or a held-back tag: wait for the rest
            delta, sent[i] = text[len(sent[i]) :], text
            if delta:
                await send(i, {"content": delta}, None)
            if fin:
                if calls:
                    await send(i, {"tool_calls": [{**c, "index": k} for k, c in enumerate(calls)]}, None)
                await send(i, {}, "tool_calls" if calls else self._finish(reqs[i]))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
