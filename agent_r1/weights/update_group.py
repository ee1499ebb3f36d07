"""The standalone process group a trainer and its rollout servers push weights through, joined the
way SGLang's servers join it (``init_custom_process_group``), so the two ends' store keys meet. A
server's gloo weight-transfer backend (``GLOO_BACKEND``, the receiving end this project installs
into an upstream engine) joins the same way. Torch only: this module is also imported inside an
upstream server's own venv, where this package's dependencies are absent."""

from __future__ import annotations

import inspect
from datetime import timedelta
from typing import Any

__all__ = ["GLOO_BACKEND", "join_update_group", "leave_update_group", "tcp_address"]

GLOO_BACKEND = "agent_r1_gloo"  # the weight-transfer backend's name on both ends (a CPU learner's push)


def tcp_address(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def join_update_group(
    backend: str,
    master_address: str,
    master_port: int,
    world_size: int,
    rank: int,
    group_name: str,
    timeout_s: float = 120.0,
) -> Any:
    """Join a weight-update group exactly as SGLang's servers do (``init_custom_process_group``):
    ``rendezvous(tcp://...)`` -> ``PrefixStore(group_name)`` -> torch's ``_new_process_group_helper``
    (which adds its own group-name and device prefixes) and the identity rank map. Rank 0 hosts the
    store. Leave with ``torch.distributed.destroy_process_group(group)``."""
    from torch.distributed import distributed_c10d as c10d

    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(
        c10d.rendezvous(tcp_address(master_address, master_port), rank, world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    store = c10d.PrefixStore(group_name, store)
    params = inspect.signature(c10d._new_process_group_helper).parameters
    options = {"backend_options" if "backend_options" in params else "pg_options": None}
    group, _ = c10d._new_process_group_helper(
        world_size,
        rank,
        [],
        c10d.Backend(backend),
        store,
        group_name=group_name,
        timeout=timeout,
        device_id=None,
        **options,
    )
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def leave_update_group(group: Any) -> None:
    import torch.distributed as dist

    try:
        dist.destroy_process_group(group)
    except (ValueError, RuntimeError):  # already gone (a failed join, a second close)
        pass
