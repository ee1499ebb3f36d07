"""The receiving end of a weight push, in a server that serves SGLang's weight-update routes (the
embedded engine's): ``WeightReceiver`` joins the trainer's update group (a standalone gloo or NCCL
process group, the trainer rank 0) and takes HF-named tensors over it, one flattened bucket per
call; ``WeightRoutes`` are the HTTP routes around it (``/init_weights_update_group``,
``/update_weights_from_distributed``, the update sessions of SGLang >= 0.5.21,
``/update_weights_from_disk``, the colocated ``/update_weights_from_tensor``). The engine behind
them only needs ``update_weights(tensors, version)``, ``update_weights_from_disk(path, version)``,
``abort(abort_all=True)``, ``weight_version`` and ``device``.
"""

from __future__ import annotations

import asyncio
import pickle
import threading
from typing import Any

import torch
from aiohttp import web

from agent_r1.http_service import BadRequest, as_object, error_response, json_response, need, read_json_body
from agent_r1.weights.buckets import deserialize_named_tensors
from agent_r1.weights.update_group import join_update_group, leave_update_group

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "uint8": torch.uint8,
}
MAX_STUCK_JOINS = 4  # joins whose master never answered; their threads cannot be stopped


def _ok(success: bool = True, message: str = "", **extra: Any) -> web.Response:
    return json_response({"success": success, "message": message, **extra}, status=200 if success else 400)


async def request_body(request: web.Request) -> dict[str, Any]:
    """A control route's JSON object body; none is ``{}``."""
    if not request.can_read_body:
        return {}
    return as_object(await read_json_body(request))


class WeightReceiver:
    """The server's end of a weight-update group: a standalone gloo (or NCCL) process group that
    the trainer (rank 0) broadcasts HF-named tensors over, one flattened bucket per call."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.groups: dict[str, Any] = {}
        self.devices: dict[str, torch.device] = {}  # NCCL receives into GPU memory, gloo into host
        self.device = torch.device(device)

    def init(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
        abandoned: threading.Event | None = None,
    ) -> None:
        """Join as SGLang's TP rank 0 does: rank ``rank_offset + 0``, through the same helper.
        ``abandoned`` set before the join returns (its request timed out): the group is left."""
        if backend not in ("gloo", "nccl"):
            raise BadRequest(f"backend: must be gloo or nccl, got {backend!r}")
        if not group_name:
            raise BadRequest("group_name: must not be empty")
        if group_name in self.groups:
            raise BadRequest(f"group_name: a weight update group {group_name!r} exists on this server")
        group = join_update_group(
            backend, master_address, int(master_port), int(world_size), int(rank_offset), group_name
        )
        if abandoned is not None and abandoned.is_set():  # its request was answered failed meanwhile
            leave_update_group(group)
            return
        self.groups[group_name] = group
        self.devices[group_name] = self.device if backend == "nccl" else torch.device("cpu")

    def destroy(self, group_name: str) -> bool:
        group = self.groups.pop(group_name, None)
        self.devices.pop(group_name, None)
        if group is not None:
            leave_update_group(group)
        return group is not None

    def receive(self, body: dict[str, Any]) -> dict[str, torch.Tensor]:
        import torch.distributed as dist

        names, dtypes = need(body, "names", "str_list"), need(body, "dtypes", "str_list")
        shapes = need(body, "shapes", "shape_list")
        name = need(body, "group_name", "text", "weight_update_group")
        group, device = self.groups.get(name), self.devices.get(name)
        if group is None:
            raise BadRequest(
                f"group_name: no weight update group {name!r}; call /init_weights_update_group first"
            )
        if not len(names) == len(dtypes) == len(shapes):
            raise BadRequest("names, dtypes and shapes must have the same length")
        bad = [d for d in dtypes if d not in DTYPES]
        if bad:
            raise BadRequest(f"dtypes: unsupported dtype {bad[0]!r}; supported: {sorted(DTYPES)}")
        specs = [(n, DTYPES[d], tuple(s)) for n, d, s in zip(names, dtypes, shapes, strict=True)]
        if body.get("load_format") == "flattened_bucket":
            # SGLang's FlattenedTensorBucket layout: byte offsets in order, each aligned to its dtype
            out, offsets, off = {}, [], 0
            for n, d, s in specs:
                if off % d.itemsize:
                    raise BadRequest(f"names: unaligned tensor {n}: byte offset {off}, dtype {d}")
                offsets.append(off)
                off += int(torch.Size(s).numel()) * d.itemsize
            flat = torch.empty(off, dtype=torch.uint8, device=device)
            dist.broadcast(flat, src=0, group=group)
            ends = offsets[1:] + [off]
            for (n, d, s), start, end in zip(specs, offsets, ends, strict=True):
                out[n] = flat[start:end].view(d).view(s).clone()
            return out
        out = {}
        for n, d, s in specs:
            t = torch.empty(s, dtype=d, device=device)
            dist.broadcast(t, src=0, group=group)
            out[n] = t
        return out


class WeightRoutes:
    """The weight-update routes of one server: an update session (``sessions``: SGLang >= 0.5.21
    loads weights only between ``/begin_weight_update`` and ``/end_weight_update``), the update
    group's joins (each within ``join_timeout_s``), and ``weight_ipc`` (``/update_weights_from_tensor``
    unpickles its body: colocated trainers only)."""

    def __init__(self, engine: Any, sessions: bool, weight_ipc: bool = False, join_timeout_s: float = 120.0):
        self.engine, self.sessions, self.weight_ipc = engine, sessions, weight_ipc
        self.receiver = WeightReceiver(engine.device)
        self.session_open = False
        self.join_timeout_s, self.stuck_joins = join_timeout_s, []

    def add_to(self, r: web.UrlDispatcher) -> None:
        r.add_post("/update_weights_from_disk", self.update_from_disk)
        r.add_post("/init_weights_update_group", self.init_group)
        r.add_post("/destroy_weights_update_group", self.destroy_group)
        r.add_post("/update_weights_from_distributed", self.update_from_distributed)
        r.add_post("/update_weights_from_tensor", self.update_from_tensor)
        if self.sessions:
            r.add_post("/begin_weight_update", self.begin_update)
            r.add_post("/end_weight_update", self.end_update)
        r.add_post("/update_weight_version", self.update_version)

    async def _body(self, request: web.Request) -> dict[str, Any]:
        return await request_body(request)

    async def update_from_disk(self, request: web.Request) -> web.Response:
        try:
            body = await self._body(request)
            path = need(body, "model_path", "text")
            version = need(body, "weight_version", "scalar", None)
            if need(body, "abort_all_requests", "bool", False):
                self.engine.abort(abort_all=True)
            await asyncio.to_thread(
                self._between_requests, self.engine.update_weights_from_disk, path, version
            )
        except BadRequest as e:
            return _ok(False, str(e))
        return _ok(True, "Succeeded to update model weights.", num_paused_requests=0)

    def _between_requests(self, update: Any, *args: Any) -> None:
        """Run ``update`` once no request runs, as SGLang's writer lock does for an update outside a
        pause: the running requests finish on the weights they started with, new ones wait."""
        if self.engine.paused is not None:  # the pusher paused it already
            update(*args)
            return
        self.engine.pause("drain")
        try:
            update(*args)
        finally:
            self.engine.resume()

    async def init_group(self, request: web.Request) -> web.Response:
        """Join the trainer's group in a thread of its own, within ``join_timeout_s``: a master that
        accepts the connection and stays silent blocks torch's store client for good, so a join
        that does not finish in time is answered as failed and its thread left behind (at most
        ``MAX_STUCK_JOINS`` of them; the pool that serves the other endpoints is never used)."""
        try:
            body = await self._body(request)
            addr = need(body, "master_address", "text")
            port = need(body, "master_port", "port")
            world = need(body, "world_size", "count")
            offset = need(body, "rank_offset", "index")
            if not 0 < offset < world:
                raise BadRequest(
                    f"rank_offset: must be in 1..world_size-1 (rank 0 is the trainer), got {offset}"
                )
            name = need(body, "group_name", "text", "weight_update_group")
            backend = need(body, "backend", "str", "gloo")
        except BadRequest as e:
            return _ok(False, str(e))
        self.stuck_joins = [t for t in self.stuck_joins if t.is_alive()]  # one that finished late is gone
        if len(self.stuck_joins) >= MAX_STUCK_JOINS:
            return _ok(
                False,
                f"init_weights_update_group refused: {len(self.stuck_joins)} earlier joins never finished",
            )
        loop, done, abandoned = asyncio.get_running_loop(), asyncio.Event(), threading.Event()
        outcome: list[BaseException | None] = []

        def join() -> None:
            try:
                self.receiver.init(addr, port, offset, world, name, backend, abandoned)
                outcome.append(None)
            except BaseException as e:  # noqa: BLE001 - reported to the request, whatever it is
                outcome.append(e)
            loop.call_soon_threadsafe(done.set)

        thread = threading.Thread(target=join, name=f"join-{name}", daemon=True)
        thread.start()
        try:
            await asyncio.wait_for(done.wait(), self.join_timeout_s)
        except TimeoutError:
            self.stuck_joins.append(thread)
            abandoned.set()  # should it finish later, the group it formed is left at once
            return _ok(
                False,
                f"init_weights_update_group failed: no rendezvous at {addr}:{port} within"
                f" {self.join_timeout_s:g} s (is a trainer listening there?)",
            )
        err = outcome[0]
        if err is not None:
            return _ok(False, f"init_weights_update_group failed: {type(err).__name__}: {err}")
        return _ok(True, "Succeeded to initialize custom process group.")

    async def destroy_group(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if not self.receiver.destroy(need(body, "group_name", "text", "weight_update_group")):
            return _ok(False, "The group to be destroyed does not exist.")
        return _ok(True, "Succeeded to destroy custom process group.")

    async def begin_update(self, request: web.Request) -> web.Response:
        try:
            body = await self._body(request)
            if body.get("selector", "all") not in ("all", "target", "draft"):
                raise BadRequest(f"selector: must be all, target or draft, got {body['selector']!r}")
        except BadRequest as e:
            return error_response(str(e))
        if self.session_open:
            return _ok(False, "a weight-update session is already open; call end_weight_update() first")
        self.session_open = True
        return _ok(True, "Success")

    async def end_update(self, request: web.Request) -> web.Response:
        if not self.session_open:
            return _ok(False, "no weight-update session is open; call begin_weight_update() first")
        self.session_open = False
        return _ok(True, "Success")

    def _outside_session(self, op: str) -> web.Response | None:
        """SGLang >= 0.5.21 answers an update outside a session with failure, receiving nothing."""
        if self.sessions and not self.session_open:
            return _ok(False, f"{op} must run between begin_weight_update() and end_weight_update()")
        return None

    async def update_from_distributed(self, request: web.Request) -> web.Response:
        refused = self._outside_session("update_weights_from_distributed")
        if refused is not None:
            return refused
        try:
            body = await self._body(request)
            if body.get("abort_all_requests"):
                self.engine.abort(abort_all=True)
            tensors = await asyncio.to_thread(self.receiver.receive, body)
            await asyncio.to_thread(self.engine.update_weights, tensors, body.get("weight_version"))
        except KeyError as e:
            return _ok(False, f"missing field {e}")
        except (BadRequest, RuntimeError) as e:
            return _ok(False, f"update_weights_from_distributed failed: {e}")
        return _ok(True, "Succeeded to update parameter online.")

    async def update_from_tensor(self, request: web.Request) -> web.Response:
        """SGLang's colocated weight update: ``serialized_named_tensors`` holds, per TP rank, a
        base64 ``ForkingPickler`` dump of ``[(name, tensor), ...]`` whose CUDA tensors travel as IPC
        handles (CPU tensors as shared memory), so the bytes never leave the device."""
        if not self.weight_ipc:
            return error_response(
                "update_weights_from_tensor: disabled; start the server with --weight-ipc (it unpickles "
                "the request body: only for a trainer on the same machine)",
                403,
            )
        refused = self._outside_session("update_weights_from_tensor")
        if refused is not None:
            return refused
        try:
            body = await self._body(request)
            blobs = body.get("serialized_named_tensors")
            if not isinstance(blobs, list) or not blobs or not all(isinstance(b, str) for b in blobs):
                raise BadRequest(
                    "serialized_named_tensors: a non-empty list of base64 strings (one per TP rank)"
                )
            if body.get("abort_all_requests"):
                self.engine.abort(abort_all=True)
            tensors: dict[str, torch.Tensor] = {}
            for blob in blobs:
                tensors.update(deserialize_named_tensors(blob))
            await asyncio.to_thread(self.engine.update_weights, tensors, body.get("weight_version"))
        except BadRequest as e:
            return _ok(False, str(e))
        except (ValueError, TypeError, RuntimeError, EOFError, pickle.UnpicklingError) as e:
            return _ok(False, f"update_weights_from_tensor failed: {type(e).__name__}: {e}")
        return _ok(True, "Succeeded to update model weights.")

    async def update_version(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        version = need(body, "new_version", "scalar")
        if need(body, "abort_all_requests", "bool", True):
            self.engine.abort(abort_all=True)
        self.engine.weight_version = str(version)
        return _ok(True, "Succeeded to update weight version.", new_version=self.engine.weight_version)
