"""The embedded server's ``/generate`` (a mixin of ``Server``): ``input_ids`` or ``text`` (single
or batch; long text tokenized off the event loop), ``n``, per-prompt parameters, ``stream`` (SSE,
cumulative chunks, ``data: [DONE]``), a client that hangs up aborting its requests; answers in
SGLang's shape (``meta_info``: finish reason, logprobs, weight version)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web

from agent_r1.engines.embedded.requests import Request
from agent_r1.http_service import (
    BadRequest,
    dumps,
    error_response,
    json_response,
    read_json_body,
)

log = logging.getLogger("agent_r1.server")
TOKENIZE_OFF_LOOP_CHARS = 1 << 16  # longer prompt text is tokenised in a thread


class GenerateRoutes:
    """``Server``'s generate route (its engine and limits)."""

    async def _prompts(self, body: dict[str, Any]) -> list[list[int]]:
        if ("text" in body) == ("input_ids" in body):
            raise BadRequest("exactly one of text / input_ids must be given")
        if "text" in body:
            texts = body["text"]
            if isinstance(texts, str):
                texts = [texts]
            if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
                raise BadRequest("text: must be a string or a list of strings")
            if sum(map(len, texts)) > TOKENIZE_OFF_LOOP_CHARS:  # /health stays responsive meanwhile
                return await asyncio.to_thread(lambda: [self.engine.tokenizer(t).input_ids for t in texts])
            return [self.engine.tokenizer(t).input_ids for t in texts]
        ids = body["input_ids"]
        if isinstance(ids, list) and ids and all(isinstance(x, list) for x in ids):
            return ids
        return [ids]

    def _per(self, body: dict[str, Any], key: str, i: int, batch: bool, default: Any) -> Any:
        v = body.get(key, default)
        if batch and isinstance(v, list) and (key != "sampling_params"):
            return v[i]
        if key == "sampling_params" and isinstance(v, list):
            return v[i]
        return v

    def _payload(self, r: Request, index: int) -> dict[str, Any]:
        s = r.sampling
        text = self.engine.tokenizer.decode(r.out_ids, skip_special_tokens=s.skip_special_tokens)
        if (
            r.finish
            and r.finish.get("type") == "stop"
            and isinstance(r.finish.get("matched"), str)
            and not s.no_stop_trim
        ):
            text = text[: text.find(r.finish["matched"])] if r.finish["matched"] in text else text
        meta: dict[str, Any] = {
            "id": r.rid,
            "finish_reason": r.finish,
            "prompt_tokens": len(r.prompt),
            "completion_tokens": len(r.out_ids),
            "cached_tokens": r.cached_tokens,
            "weight_version": r.weight_version if r.finish else self.engine.weight_version,
            "num_retractions": r.retractions,
        }
        if r.finish:
            meta["e2e_latency"] = r.finished_at - r.created
        if r.return_logprob:
            meta["output_token_logprobs"] = [
                [lp, t, None] for lp, t in zip(r.out_logprobs, r.out_ids, strict=False)
            ]
            meta["output_token_logprobs_length"] = len(r.out_ids)
            if r.logprob_start_len >= 0:
                start = r.logprob_start_len
                meta["input_token_logprobs"] = [
                    [lp, t, None] for lp, t in zip(r.input_logprobs, r.prompt[start:], strict=False)
                ]
            if r.top_logprobs_num:
                meta["output_top_logprobs"] = [[[lp, t, None] for lp, t in top] for top in r.out_top]
        return {"text": text, "output_ids": list(r.out_ids), "index": index, "meta_info": meta}

    async def generate(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await read_json_body(request)
        except BadRequest as e:
            return error_response(str(e), e.status)
        if not isinstance(body, dict):
            return error_response(f"request body must be a JSON object, got {type(body).__name__}")
        loop = asyncio.get_running_loop()
        try:
            prompts = await self._prompts(body)
            batch = (
                len(prompts) > 1
                or isinstance(body.get("text"), list)
                or (
                    isinstance(body.get("input_ids"), list)
                    and body["input_ids"]
                    and isinstance(body["input_ids"][0], list)
                )
            )
            reqs: list[Request] = []
            for i, p in enumerate(prompts):
                rid = self._per(body, "rid", i, batch, None)
                reqs += self.engine.make_requests(
                    p,
                    self._per(body, "sampling_params", i, batch, None),
                    rid=rid,
                    return_logprob=bool(self._per(body, "return_logprob", i, batch, False)),
                    top_logprobs_num=self._per(body, "top_logprobs_num", i, batch, 0),
                    logprob_start_len=self._per(body, "logprob_start_len", i, batch, -1),
                    image_data=self._per(body, "image_data", i, batch, None),
                )
                if len(reqs) > self.max_batch_seqs:  # before building the rest of a huge batch
                    return error_response(
                        f"a /generate of more than {self.max_batch_seqs} sequences (prompts x n); "
                        "this server takes at most that many in one request (--max-batch-seqs)",
                        413,
                    )
        except BadRequest as e:
            return error_response(str(e), e.status)
        except (TypeError, KeyError, IndexError) as e:
            return error_response(f"malformed request: {e}")
        queue: asyncio.Queue[tuple[Request, bool]] = asyncio.Queue()

        stream = bool(body.get("stream"))
        index = {id(r): i for i, r in enumerate(reqs)}

        def cb(r: Request, finished: bool) -> None:
            if not (stream or finished):  # a whole answer waits for the end: waking the event loop
                return  # per token took the GIL from the scheduler (5-10 % of a busy engine's speed)
            # streaming: snapshot the chunk now (the engine keeps appending tokens meanwhile)
            chunk = self._payload(r, index[id(r)]) if stream else None
            loop.call_soon_threadsafe(queue.put_nowait, (r, finished, chunk))

        for r in reqs:
            r.on_update = cb
        self.engine.submit(reqs)
        many = batch or len(reqs) > 1
        if body.get("stream"):
            return await self._stream(request, reqs, queue, many)
        left = len(reqs)
        try:
            while left:
                _, finished, _ = await queue.get()
                left -= finished
        except asyncio.CancelledError:  # client went away (handler cancellation): free the engine
            self.engine.abort(rids=[r.rid for r in reqs])  # one pass
            raise
        out = [self._payload(r, i) for i, r in enumerate(reqs)]
        return json_response(out if many else out[0])

    async def _stream(
        self, request: web.Request, reqs: list[Request], queue: asyncio.Queue, many: bool
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        left = len(reqs)
        try:
            while left:
                _, finished, chunk = await queue.get()
                left -= finished
                await resp.write(f"data: {dumps(chunk)}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            self.engine.abort(rids=[r.rid for r in reqs])  # one pass
            raise
        await resp.write_eof()
        return resp
