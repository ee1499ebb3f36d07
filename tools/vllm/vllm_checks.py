"""Checks run *inside* the vLLM venv (``tools/vllm/build_venv.sh``) with vLLM's own code; the
contract tests drive them and read their JSON answer (the last line of stdout).

    python vllm_checks.py argv FILE      # [argv, ...] (after `vllm serve`) -> what vLLM's parser made of each
    python vllm_checks.py bodies FILE    # {"completions": [body, ...], "routes": {"POST /path": body},
                                         #  "nccl": {"init_info": {...}, "update_info": {...}}}
                                         # -> per body: fields vLLM does not know, validation errors
"""

from __future__ import annotations

import json
import sys


def argv(items: list[list[str]]) -> dict:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    out = []
    for a in items:
        ns = make_arg_parser(FlexibleArgumentParser()).parse_args(a)
        out.append(
            {
                "model": ns.model_tag or ns.model,
                "host": ns.host,
                "port": ns.port,
                "dtype": ns.dtype,
                "max_model_len": ns.max_model_len,
                "max_num_seqs": ns.max_num_seqs,
                "tensor_parallel_size": ns.tensor_parallel_size,
                "generation_config": ns.generation_config,
                "logprobs_mode": ns.logprobs_mode,
                "enable_prefix_caching": ns.enable_prefix_caching,
                "enforce_eager": ns.enforce_eager,
                "api_key": ns.api_key,
                "weight_transfer_backend": ns.weight_transfer_config.backend,
                "gpu_memory_utilization": ns.gpu_memory_utilization,
            }
        )
    return {"parsed": out}


def bodies(spec: dict) -> dict:
    import pydantic
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.rl.online.api_router import router as rl_routes
    from vllm.entrypoints.serve.dev.cache.api_router import router as cache_routes

    completions = []
    for body in spec["completions"]:
        unknown = sorted(set(body) - set(CompletionRequest.model_fields))
        try:
            req = CompletionRequest.model_validate(body)
            sp = req.to_sampling_params(max_tokens=body.get("max_tokens") or 16, default_sampling_params={})
            completions.append(
                {
                    "unknown": unknown,
                    "error": None,
                    "sampling": {
                        "temperature": sp.temperature,
                        "top_p": sp.top_p,
                        "top_k": sp.top_k,
                        "max_tokens": sp.max_tokens,
                        "logprobs": sp.logprobs,
                        "stop_token_ids": sp.stop_token_ids,
                        "seed": sp.seed,
                        "skip_special_tokens": sp.skip_special_tokens,
                    },
                }
            )
        except (pydantic.ValidationError, ValueError) as e:
            completions.append({"unknown": unknown, "error": str(e)[:500]})
    table = {}
    for r in [*rl_routes.routes, *cache_routes.routes]:
        for m in r.methods:
            table[f"{m} {r.path}"] = (
                {p.name for p in r.dependant.body_params},
                {p.name for p in r.dependant.query_params},
            )
    routes = {}
    for key, body in spec["routes"].items():
        path, _, query = key.partition("?")
        if path not in table:
            routes[key] = {"error": "no such route"}
            continue
        body_names, query_names = table[path]
        given_query = {q.split("=")[0] for q in query.split("&") if q}
        routes[key] = {
            "error": None,
            "unknown_body": sorted(set(body or {}) - body_names),
            "unknown_query": sorted(given_query - query_names),
        }
    return {"completions": completions, "routes": routes, "nccl": nccl(spec.get("nccl") or {})}


def nccl(spec: dict) -> dict:
    """The NCCL backend's own init and update types take the bodies a GPU trainer sends, and the
    trainer-side helper takes the call it makes."""
    import inspect

    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo, trainer_init
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo

    out = {"trainer_init": sorted(inspect.signature(trainer_init).parameters)}
    for key, cls in (
        ("init_info", NCCLWeightTransferInitInfo),
        ("update_info", NCCLWeightTransferUpdateInfo),
    ):
        try:
            cls(**spec[key])
            out[key] = None
        except (TypeError, ValueError) as e:
            out[key] = str(e)[:300]
    return out


if __name__ == "__main__":
    what, path = sys.argv[1], sys.argv[2]
    arg = json.loads(open(path).read())
    import vllm

    answer = {"argv": argv, "bodies": bodies}[what](arg)
    answer["vllm"] = vllm.__version__
    print(json.dumps(answer))
