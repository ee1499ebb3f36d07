"""``agent-r1 serve``: the embedded rollout engine behind SGLang's HTTP API (and OpenAI's)."""

from __future__ import annotations

import argparse
from pathlib import Path

from agent_r1 import cli_args
from agent_r1.commands.flags import add_api_key_flags, api_key
from agent_r1.cpus import serving_dtype, usable_cpus
from agent_r1.logging import setup_logging


def add_parser(sub: argparse._SubParsersAction) -> None:
    sv = sub.add_parser("serve", help="the embedded rollout engine behind SGLang's HTTP API")
    sv.add_argument("--model", required=True, help="HF model folder")
    sv.add_argument(
        "--served-model-name",
        default=None,
        help="the model's id in the OpenAI API (default: the folder name)",
    )
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=cli_args.port, default=30000, help="0 = any free port")
    sv.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="auto: bfloat16 on a GPU or a CPU with bf16 units (AVX512_BF16, AMX), else float32",
    )
    sv.add_argument(
        "--max-running", type=cli_args.positive_int, default=64, help="concurrent requests (KV slots)"
    )
    sv.add_argument(
        "--max-len", type=cli_args.positive_int, default=None, help="tokens per request (prompt + output)"
    )
    sv.add_argument(
        "--prefill-chunk", type=cli_args.positive_int, default=2048, help="prefill tokens per scheduler step"
    )
    sv.add_argument(
        "--threads",
        type=cli_args.positive_int,
        default=None,
        help="torch threads (default: the cores this process may use: its CPU affinity, Slurm's --cpus-per-task)",
    )
    sv.add_argument("--device", default="cpu", help="where the model and KV cache live: cpu, cuda, cuda:N")
    sv.add_argument(
        "--batch-invariant",
        action="store_true",
        help="a request's tokens and logprobs are the same bits alone or in any batch (with its "
        "sampling_seed); dense models on the CPU; slower for tiny models",
    )
    sv.add_argument(
        "--weight-ipc",
        action="store_true",
        help="accept /update_weights_from_tensor (CUDA IPC / shared memory from a trainer on this machine)",
    )
    sv.add_argument(
        "--ready-file", help="write {url} here once listening (run_dir/control/servers/NAME.json)"
    )
    add_api_key_flags(sv)
    sv.add_argument(
        "--max-body-mb",
        type=cli_args.positive_int,
        default=256,
        help="larger request bodies are refused with 413",
    )
    sv.add_argument(
        "--max-batch-seqs",
        type=cli_args.positive_int,
        default=4096,
        help="a /generate of more sequences (prompts x n) is refused with 413",
    )
    sv.add_argument(
        "--max-prompt-tokens",
        type=cli_args.nonneg_int,
        default=0,
        help="longer prompts are refused with 413 (0: the context length bounds them)",
    )
    sv.add_argument(
        "--max-client-requests",
        type=cli_args.positive_int,
        default=1024,
        help="requests one client address may have in flight at once; more are refused with 429",
    )
    sv.add_argument(
        "--max-header-bytes",
        type=cli_args.positive_int,
        default=8190,
        help="the longest request line or header; longer ones are refused with 400",
    )
    sv.add_argument(
        "--strict",
        action="store_true",
        help="serve only the endpoints upstream SGLang serves (404 for the rest): what the trainer uses",
    )
    sv.add_argument(
        "--sglang-version",
        help="the SGLang release whose protocol to speak (default: the newest checked, 0.5.23; before "
        "0.5.21 weights load without an update session)",
    )
    sv.add_argument(
        "--join-timeout-s",
        type=cli_args.nonneg_float,
        default=120.0,
        help="how long /init_weights_update_group waits for the trainer's rendezvous",
    )
    sv.set_defaults(fn=run)


def run(a: argparse.Namespace) -> int:
    from agent_r1.engines.embedded.server import serve
    from agent_r1.serving.openai_api import OpenAIRoutes

    setup_logging("server")
    name = a.served_model_name or Path(a.model).resolve().name
    serve(
        a.model,
        a.host,
        a.port,
        a.ready_file,
        routes=lambda server: OpenAIRoutes(server, name),  # SGLang serves them too
        dtype=serving_dtype(a.device) if a.dtype == "auto" else a.dtype,
        max_running=a.max_running,
        max_len=a.max_len,
        prefill_chunk=a.prefill_chunk,
        threads=a.threads or (usable_cpus() if a.device == "cpu" else None),
        device=a.device,
        batch_invariant=a.batch_invariant,
        weight_ipc=a.weight_ipc,
        api_key=api_key(a),
        max_body_mb=a.max_body_mb,
        max_batch_seqs=a.max_batch_seqs,
        max_prompt_tokens=a.max_prompt_tokens,
        max_client_requests=a.max_client_requests,
        max_header_bytes=a.max_header_bytes,
        strict=a.strict,
        sglang_version=a.sglang_version,
        join_timeout_s=a.join_timeout_s,
    )
    return 0
