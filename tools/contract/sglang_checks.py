"""Checks run *inside* the SGLang contract environment (``tools/contract/build_env.sh``), with the
upstream release's own code; the contract tests drive them and read their JSON answer.

    python sglang_checks.py bodies FILE      # {"Type": [body, ...]} -> per body: ok / what is wrong
    python sglang_checks.py argv FILE        # [["--model-path", ...], ...] -> upstream's parser
    python sglang_checks.py receive FILE     # join the update group as a server TP rank and receive
                                             # one flattened bucket the way the release does
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import inspect
import json
import sys
from pathlib import Path

import stand_ins  # noqa: F401 - GPU-only imports first


def run_as_pinned_torch() -> None:
    """Present torch's version as the one the release pins (its METADATA's ``torch==X``). SGLang
    0.5.6 picks ``_new_process_group_helper``'s keyword by comparing version *strings*
    (``"2.13.0" >= "2.6"`` is false) and would pass the pre-2.6 ``pg_options`` to this torch; on the
    torch it ships with it passes ``backend_options``, which this torch takes too."""
    import torch

    for line in importlib.metadata.distribution("sglang").requires or []:
        if line.replace(" ", "").startswith("torch==") and ";" not in line:
            torch.__version__ = line.split("==", 1)[1].strip()


def fields_of(cls) -> set[str]:
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    import msgspec

    return {f.name for f in msgspec.structs.fields(cls)}


def validate(cls, body: dict) -> str | None:
    """None if upstream's request type takes ``body``; else what is wrong, naming the field."""
    unknown = sorted(set(body) - fields_of(cls))
    if unknown:
        return f"{cls.__name__}: unknown field(s) {unknown}"
    try:  # what FastAPI does with the body: pydantic (dataclasses; msgspec structs via their schema)
        import pydantic

        pydantic.TypeAdapter(cls).validate_python(body)
    except Exception as e:  # noqa: BLE001 - the message is the answer
        errors = e.errors() if hasattr(e, "errors") else []
        where = sorted({".".join(str(x) for x in err.get("loc", ())) for err in errors})
        return f"{cls.__name__}: {type(e).__name__} at {where}: {str(e)[:300]}"
    return None


def check_bodies(spec: dict) -> dict:
    from sglang.srt.managers import io_struct
    from sglang.srt.sampling.sampling_params import SamplingParams

    out: dict[str, list] = {}
    for type_name, bodies in spec.items():
        cls = getattr(io_struct, type_name, None)
        if cls is None:
            out[type_name] = ["absent"] * len(bodies)
            continue
        answers = []
        for body in bodies:
            why = validate(cls, body)
            if why is None and type_name == "GenerateReqInput":  # sampling_params: a plain dict upstream
                known = (
                    fields_of(SamplingParams)
                    if not inspect.isfunction(SamplingParams.__init__)
                    else set(inspect.signature(SamplingParams.__init__).parameters) - {"self"}
                )
                extra = sorted(set(body.get("sampling_params", {})) - known)
                if extra:
                    why = f"SamplingParams: unknown field(s) {extra}"
                else:
                    try:
                        SamplingParams(**body.get("sampling_params", {})).verify(1 << 20)
                    except TypeError:  # verify's signature differs between releases
                        SamplingParams(**body.get("sampling_params", {})).verify()
                    except Exception as e:  # noqa: BLE001
                        why = f"SamplingParams: {e}"
            answers.append(why or "ok")
        out[type_name] = answers
    return out


def check_argvs(argvs: list[list[str]]) -> dict:
    return {"commands": [check_argv(a) for a in argvs]}


def check_argv(argv: list[str]) -> dict:
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    try:
        ns = parser.parse_args(argv)
    except SystemExit as e:
        return {"error": f"upstream's parser refused the command (exit {e.code})"}
    # each option's parsed value under its own name (upstream's dests differ: --tp-size ->
    # tensor_parallel_size in 0.5.6)
    parsed = {}
    for action in parser._actions:
        value = getattr(ns, action.dest, None)
        if isinstance(value, (str, int, float, bool, type(None))):
            parsed.update({opt: value for opt in action.option_strings if opt.startswith("--")})
    return {"parsed": parsed}


def receive(spec: dict) -> dict:
    """One server TP rank: ``init_custom_process_group`` as the model runner calls it, then the
    release's own receive of a flattened bucket; answers each tensor's sha256."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    run_as_pinned_torch()
    from sglang.srt.utils import init_custom_process_group
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    group = init_custom_process_group(
        backend="gloo",
        init_method=f"tcp://{spec['master_address']}:{spec['master_port']}",
        timeout=timedelta(seconds=60),
        world_size=spec["world_size"],
        rank=spec["rank_offset"] + spec.get("tp_rank", 0),
        group_name=spec["group_name"],
    )
    names, dtypes, shapes = spec["names"], spec["dtypes"], spec["shapes"]
    if hasattr(FlattenedTensorBucket, "empty"):  # 0.5.2x: weight_updater._receive_bucketed_...
        bucket = FlattenedTensorBucket.empty(names, dtypes, shapes, "cpu")
    else:  # 0.5.6: model_runner builds the bucket from empty tensors
        bucket = FlattenedTensorBucket(
            named_tensors=[
                (n, torch.empty(s, dtype=getattr(torch, d)))
                for n, d, s in zip(names, dtypes, shapes, strict=True)
            ]
        )
    flat = bucket.get_flattened_tensor()
    dist.broadcast(flat, src=0, group=group)
    got = {
        n: hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
        for n, t in bucket.reconstruct_tensors()
    }
    dist.destroy_process_group(group)
    return {"sha256": got}


def main() -> int:
    what, path = sys.argv[1], Path(sys.argv[2])
    arg = json.loads(path.read_text())
    answer = {"bodies": check_bodies, "argv": check_argvs, "receive": receive}[what](arg)
    answer["sglang"] = importlib.metadata.version("sglang") if _has_metadata() else "?"
    print(json.dumps(answer))
    return 0


def _has_metadata() -> bool:
    try:
        importlib.metadata.version("sglang")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


if __name__ == "__main__":
    sys.exit(main())
