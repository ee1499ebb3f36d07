"""The shared-filesystem transport: the weights as ``model.safetensors`` in a run's ``weights/vN``,
every server told to load it (``/update_weights_from_disk``, the route SGLang and the embedded
engine share)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from pathlib import Path

import torch

from agent_r1.rollout.client import RolloutClient
from agent_r1.weights.transport import WeightSyncError


async def push_weights_from_disk(
    servers: list[str],
    named: Iterable[tuple[str, torch.Tensor]] | None,
    out_dir: str | Path,
    version: int | str,
    api_key: str | None = None,
) -> None:
    """Write ``model.safetensors`` under ``out_dir`` (shared filesystem) and have every server load
    it; ``named=None`` only has the servers load what ``out_dir`` already holds (a late server)."""
    out = Path(out_dir)
    if named is not None:
        from safetensors.torch import save_file

        out.mkdir(parents=True, exist_ok=True)
        tmp = out / ".model.safetensors.tmp"
        save_file({n: t.detach().contiguous().cpu() for n, t in named}, str(tmp))
        tmp.replace(out / "model.safetensors")
    client = RolloutClient(servers=servers, api_key=api_key)
    try:
        answers = await asyncio.gather(
            *(
                client.post(
                    s, "/update_weights_from_disk", {"model_path": str(out), "weight_version": str(version)}
                )
                for s in servers
            ),
            return_exceptions=True,
        )
    finally:
        await client.close()
    bad = [
        f"{s}: {a}"
        for s, a in zip(servers, answers, strict=True)
        if isinstance(a, BaseException) or not a.get("success")
    ]
    if bad:
        raise WeightSyncError(f"update_weights_from_disk failed on: {bad}")
