"""``agent-r1 serve``: the embedded engine behind SGLang's native HTTP API (the subset RL needs).

Errors answer 400 with ``{"error": {"message": ...}}`` naming the field; control endpoints answer
``{"success": bool, "message": str}`` like SGLang. ``/generate`` accepts ``input_ids`` or
``text`` (single or batch), ``n``, ``stream`` (SSE, cumulative chunks, ``data: [DONE]``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

from aiohttp import web

from agent_r1.engines.embedded.engine import PAUSE_MODES, Engine, checkpoint_tensors
from agent_r1.engines.embedded.generate import GenerateRoutes
from agent_r1.http_service import (
    MAX_CLIENT_REQUESTS,
    MAX_HEADER_BYTES,
    BadRequest,
    api_key_middleware,
    client_limit,
    error_response,
    json_response,
    need,
    service_errors,
    start_site,
    write_ready,
)
from agent_r1.weights.receiver import WeightRoutes, request_body
from agent_r1.weights.sglang import SGLANG_SESSIONS_FROM
from agent_r1.weights.transport import release

log = logging.getLogger("agent_r1.server")
ENGINE = "agent-r1-embedded-0.1"
# the SGLang release whose HTTP protocol this server speaks (``/server_info`` "version"; clients
# gate on it); ``--sglang-version`` picks an older one (no update sessions before 0.5.21)
SGLANG_PROTOCOL = "0.5.23"


# what upstream SGLang 0.5.x serves of this server's routes; `--strict` serves only these (the rest
# answer 404), so code that works against a strict server works against real SGLang
UPSTREAM_ENDPOINTS = frozenset(
    {
        "/generate",
        "/health",
        "/health_generate",
        "/get_server_info",
        "/server_info",
        "/get_model_info",
        "/model_info",
        "/v1/loads",
        "/flush_cache",
        "/abort_request",
        "/pause_generation",
        "/continue_generation",
        "/update_weights_from_disk",
        "/init_weights_update_group",
        "/destroy_weights_update_group",
        "/update_weights_from_distributed",
        "/update_weights_from_tensor",
        "/begin_weight_update",
        "/end_weight_update",
        "/update_weight_version",
        "/get_weights_by_name",
        "/release_memory_occupation",
        "/resume_memory_occupation",
    }
)


@web.middleware
async def _log_not_found(request: web.Request, handler):
    """Strict mode: a call to something upstream SGLang lacks is logged (tests look for it)."""
    try:
        return await handler(request)
    except web.HTTPNotFound:
        log.warning("strict: 404 for %s %s (not an upstream SGLang endpoint)", request.method, request.path)
        raise


class Server(GenerateRoutes):
    def __init__(
        self,
        engine: Engine,
        host: str = "127.0.0.1",
        port: int = 30000,
        weight_ipc: bool = False,
        api_key: str | None = None,
        max_body_mb: int = 256,
        strict: bool = False,
        sglang_version: str = SGLANG_PROTOCOL,
        join_timeout_s: float = 120.0,
        max_batch_seqs: int = 4096,
        max_client_requests: int = MAX_CLIENT_REQUESTS,
        max_header_bytes: int = MAX_HEADER_BYTES,
    ):
        """``strict``: serve only what upstream SGLang serves (``UPSTREAM_ENDPOINTS``).
        ``sglang_version``: the release whose protocol to speak; from 0.5.21 weights load only
        inside a ``/begin_weight_update`` ... ``/end_weight_update`` session, as SGLang's do."""
        self.engine, self.host, self.port = engine, host, port
        self.max_header_bytes = max_header_bytes
        self.max_batch_seqs = max_batch_seqs  # sequences (prompts x n) one /generate may ask for
        v = release(sglang_version)
        if v is None:
            raise ValueError(f"sglang_version: not a release number: {sglang_version!r}")
        self.sglang_version, self.sessions = sglang_version, v >= SGLANG_SESSIONS_FROM
        # the weight-update routes: the receiving end of every push (weights/receiver.py)
        self.weight_routes = WeightRoutes(engine, self.sessions, weight_ipc, join_timeout_s)
        middlewares = [client_limit(max_client_requests)]
        if api_key:
            middlewares.append(api_key_middleware(api_key))
        if strict:
            middlewares.append(_log_not_found)
        middlewares.append(service_errors(error_response))
        self.app = web.Application(client_max_size=max_body_mb << 20, middlewares=middlewares)
        r = self.app.router
        r.add_route("*", "/generate", self.generate)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health_generate)
        for p in ("/get_server_info", "/server_info"):
            r.add_get(p, self.server_info)
        for p in ("/get_model_info", "/model_info"):
            r.add_get(p, self.model_info)
        r.add_get("/v1/loads", self.loads)
        r.add_route("*", "/flush_cache", self.flush_cache)
        r.add_post("/abort_request", self.abort_request)
        r.add_post("/pause_generation", self.pause)
        r.add_post("/continue_generation", self.resume)
        self.weight_routes.add_to(r)
        r.add_post("/get_weights_by_name", self.weights_by_name)
        r.add_post("/release_memory_occupation", self.noop)
        r.add_post("/resume_memory_occupation", self.noop)
        if not strict:  # the embedded server's own additions
            r.add_get("/get_weight_version", self.get_version)

    # ---- health / info ---------------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        alive = self.engine._thread is not None and self.engine._thread.is_alive()
        return web.Response(status=200 if alive else 503)

    async def health_generate(self, request: web.Request) -> web.Response:
        if self.engine.paused is not None or self.engine.running:
            return web.Response(status=200)  # busy serving = healthy
        loop = asyncio.get_running_loop()
        reqs = self.engine.make_requests([0], {"max_new_tokens": 1, "temperature": 0})
        done = asyncio.Event()
        reqs[0].on_update = lambda r, f: f and loop.call_soon_threadsafe(done.set)
        self.engine.submit(reqs)
        try:
            await asyncio.wait_for(done.wait(), 20)
        except TimeoutError:
            return web.Response(status=503)
        return web.Response(status=200)

    async def server_info(self, request: web.Request) -> web.Response:
        e = self.engine
        return json_response(
            {
                "model_path": e.model_dir,
                "tokenizer_path": e.model_dir,
                "served_model_name": e.model_dir,
                "host": self.host,
                "port": self.port,
                "dp_size": 1,
                "tp_size": 1,
                "dtype": e.dtype,
                "context_length": e.max_len,
                "max_req_input_len": e.max_len - 1,
                "max_total_num_tokens": e.max_running * e.max_len,
                "max_running_requests": e.max_running,
                "chunked_prefill_size": e.prefill_chunk,
                "weight_version": e.weight_version,
                "version": self.sglang_version,
                "engine": ENGINE,
                "internal_states": [{**e.loads(), **e.stats}],
                # not SGLang's (its one addition a run uses, strict or not): the pause modes, ``drain``
                # among them, which a push uses to be step-atomic without aborting anything
                "pause_modes": list(PAUSE_MODES),
            }
        )

    async def model_info(self, request: web.Request) -> web.Response:
        cfg = self.engine.model.config
        return json_response(
            {
                "model_path": self.engine.model_dir,
                "tokenizer_path": self.engine.model_dir,
                "served_model_name": self.engine.model_dir,
                "is_generation": True,
                "weight_version": self.engine.weight_version,
                "model_type": cfg.model_type,
                "architectures": getattr(cfg, "architectures", None),
                "preferred_sampling_params": None,
                "has_image_understanding": self.engine.vision is not None,
            }
        )

    async def loads(self, request: web.Request) -> web.Response:
        return json_response(
            {
                "timestamp": time.time(),
                "version": self.sglang_version,
                "accelerator": "cpu",
                "num_accelerators": 0,
                "loads": [{"dp_rank": 0, **self.engine.loads()}],
            }
        )

    # ---- control -------------------------------------------------------------------------------------------
    async def _body(self, request: web.Request) -> dict[str, Any]:
        return await request_body(request)

    async def flush_cache(self, request: web.Request) -> web.Response:
        if self.engine.flush_cache():
            return web.Response(text="Cache flushed.\nPlease check backend logs for more details.")
        return web.Response(status=400, text="Cache not flushed: requests are running or waiting.")

    async def abort_request(self, request: web.Request) -> web.Response:
        try:
            body = await self._body(request)
            if not isinstance(body.get("rid", ""), str):
                raise BadRequest(f"rid: must be a string, got {type(body['rid']).__name__}")
        except BadRequest as e:
            return error_response(str(e))
        self.engine.abort(body.get("rid", ""), bool(body.get("abort_all", False)))
        return web.Response(status=200)

    async def pause(self, request: web.Request) -> web.Response:
        """SGLang's pause modes, and ``drain`` (answered once no request runs)."""
        try:
            body = await self._body(request)
            mode = body.get("mode", "abort")
            interrupt = need(body, "interrupt_tokens", "index", 0)
            interrupted = await asyncio.to_thread(self.engine.pause, mode, interrupt)
        except BadRequest as e:
            return error_response(str(e))
        return json_response(
            {"message": "Generation paused successfully.", "status": "ok", "interrupted": interrupted}
        )

    async def resume(self, request: web.Request) -> web.Response:
        self.engine.resume()
        return json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def get_version(self, request: web.Request) -> web.Response:
        return json_response({"weight_version": self.engine.weight_version})

    async def weights_by_name(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        params = checkpoint_tensors(self.engine.model)
        name = need(body, "name", "text")
        size = need(body, "truncate_size", "index", 100)
        if name not in params:
            return error_response(f"name: unknown parameter {name!r}")
        return json_response(params[name].detach().flatten()[:size].tolist())

    async def noop(self, request: web.Request) -> web.Response:
        return json_response(None)

    # ---- running ----------------------------------------------------------------------------------------------
    async def start(self) -> web.AppRunner:
        runner, self.port = await start_site(
            self.app, self.host, self.port, max_header_bytes=self.max_header_bytes
        )
        return runner


def serve(
    model: str,
    host: str = "127.0.0.1",
    port: int = 30000,
    ready_file: str | None = None,
    stop_when: Any = None,
    on_ready: Any = None,
    routes: Any = None,
    **engine_kw: Any,
) -> None:
    """Serve until interrupted: the scheduler runs in the main thread (fastest for torch on CPU),
    HTTP in a background event loop. Once serving, ``on_ready(url)`` runs (e.g. registering with a
    router), then ``ready_file`` gets ``{"url": ...}``; ``stop_when()`` true ends the server.
    ``routes(server)`` adds routes before it starts (``agent-r1 serve``: the OpenAI API)."""
    import signal

    weight_ipc = bool(engine_kw.pop("weight_ipc", False))
    api_key = engine_kw.pop("api_key", None)
    max_body_mb = int(engine_kw.pop("max_body_mb", 256))
    max_batch_seqs = int(engine_kw.pop("max_batch_seqs", None) or 4096)
    max_client_requests = int(engine_kw.pop("max_client_requests", None) or MAX_CLIENT_REQUESTS)
    max_header_bytes = int(engine_kw.pop("max_header_bytes", None) or MAX_HEADER_BYTES)
    strict = bool(engine_kw.pop("strict", False))
    sglang_version = str(engine_kw.pop("sglang_version", None) or SGLANG_PROTOCOL)
    join_timeout_s = float(engine_kw.pop("join_timeout_s", None) or 120.0)
    engine = Engine(model, **engine_kw)
    server = Server(
        engine,
        host,
        port,
        weight_ipc=weight_ipc,
        api_key=api_key,
        max_body_mb=max_body_mb,
        max_batch_seqs=max_batch_seqs,
        max_client_requests=max_client_requests,
        max_header_bytes=max_header_bytes,
        strict=strict,
        sglang_version=sglang_version,
        join_timeout_s=join_timeout_s,
    )
    if routes is not None:
        routes(server)
    loop = asyncio.new_event_loop()
    started = threading.Event()
    failed: list[BaseException] = []

    def http_thread() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(server.start())
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            failed.append(e)
            started.set()
            return
        started.set()
        loop.run_forever()

    threading.Thread(target=http_thread, name="http", daemon=True).start()
    started.wait()
    if failed:
        raise failed[0]
    url = f"http://{server.host}:{server.port}"
    log.info("serving %s at %s (%s, %s)", model, url, engine.dtype, engine.device)

    def publish() -> None:  # once the scheduler runs: /health answers 200 from then on
        while engine._thread is None:
            time.sleep(0.01)
        if on_ready is not None:
            try:
                on_ready(url)
            except Exception:  # noqa: BLE001 - unpublished, the server is useless: stop it
                log.exception("on_ready failed; stopping")
                engine.stop()
                return
        if ready_file:
            write_ready(ready_file, url, model=model)

    threading.Thread(target=publish, name="publish", daemon=True).start()
    signal.signal(signal.SIGTERM, lambda *_: engine.stop())
    if stop_when is not None:  # e.g. the run directory's SHUTDOWN file: exit 0, not killed

        def watch() -> None:
            while not stop_when():
                time.sleep(1.0)
            log.info("shutdown requested: stopping")
            engine.stop()

        threading.Thread(target=watch, name="shutdown-watch", daemon=True).start()
    try:
        engine.run_forever()
    except KeyboardInterrupt:
        pass
    finally:
        loop.call_soon_threadsafe(loop.stop)
