"""Tensors in transit: grouped into byte-bounded buckets, flattened into one uint8 tensor each (the
layout of SGLang's ``FlattenedTensorBucket``, which vLLM's packed transfer shares), or pickled as
shared-memory / CUDA IPC handles for a colocated server."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

DTYPE_NAMES = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.uint8: "uint8",
}


def buckets(
    named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group tensors in order into buckets of at most ``bucket_bytes`` (a larger tensor goes alone).
    A tensor whose byte offset in the bucket would not be a multiple of its element size starts a
    new bucket: SGLang's ``FlattenedTensorBucket`` views each tensor at its offset and refuses an
    unaligned one."""
    cur: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named:
        n = t.numel() * t.element_size()
        if cur and (size + n > bucket_bytes or size % t.element_size()):
            yield cur
            cur, size = [], 0
        cur.append((name, t))
        size += n
    if cur:
        yield cur


def flatten(bucket: list[tuple[str, torch.Tensor]], device: torch.device | str = "cpu") -> torch.Tensor:
    """One uint8 tensor of the bucket's bytes on ``device`` (the layout of SGLang's
    ``FlattenedTensorBucket``): the GPU for NCCL (no host copy), the CPU for gloo."""
    return torch.cat([t.detach().contiguous().to(device).view(-1).view(torch.uint8) for _, t in bucket])


def serialize_named_tensors(named: dict[str, torch.Tensor]) -> str:
    """``[(name, tensor), ...]`` pickled with torch's multiprocessing reductions, base64: a CUDA
    tensor becomes an IPC handle into this process's memory (a CPU tensor moves to shared memory),
    so the receiver maps the same bytes. Keep the tensors alive until the receiver has answered."""
    import base64
    import io
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401 - registers the tensor reductions with ForkingPickler

    buf = io.BytesIO()
    ForkingPickler(buf, 4).dump([(n, t.detach().contiguous()) for n, t in named.items()])
    return base64.b64encode(buf.getvalue()).decode()


def deserialize_named_tensors(blob: str) -> dict[str, torch.Tensor]:
    import base64
    import pickle

    import torch.multiprocessing  # noqa: F401 - registers the reductions the pickle refers to

    return dict(pickle.loads(base64.b64decode(blob)))
