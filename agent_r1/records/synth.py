"""Synthetic but realistic step records for tests and benchmarks.

Groups share a prompt; trajectories have 1..max_steps steps of varying action and feedback length;
observations grow in append mode (``prefix_len`` = previous obs + action); non-terminal steps carry
tool-call process rewards, terminal steps a 0/1 outcome whose rate depends on the group; every step
has a critic value (and per-token values and teacher logprobs); a few tokens are masked (forced) and some trajectories end truncated.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa

from agent_r1.records.schema import STEP_SCHEMA


def _lists(arrays: list[np.ndarray], type_: pa.DataType) -> pa.Array:
    lengths = np.fromiter((len(a) for a in arrays), dtype=np.int64, count=len(arrays))
    offsets = np.zeros(len(arrays) + 1, dtype=np.int32 if lengths.sum() < 2**31 else np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = np.concatenate(arrays) if arrays else np.zeros(0)
    cls = pa.ListArray if offsets.dtype == np.int32 else pa.LargeListArray
    arr = cls.from_arrays(pa.array(offsets), pa.array(values, type=type_))
    return arr if cls is pa.ListArray else arr.cast(pa.list_(type_))


def synth_table(
    trajectories: int,
    group_size: int = 4,
    max_steps: int = 6,
    seed: int = 0,
    prompt_len: tuple[int, int] = (16, 64),
    action_len: tuple[int, int] = (4, 48),
    feedback_len: tuple[int, int] = (2, 24),
    vocab: int = 32000,
    policy_version: int = 0,
    id_prefix: str = "it0",
) -> pa.Table:
    """``trajectories`` episodes in groups of ``group_size`` (the last group may be smaller)."""
    rng = np.random.default_rng(seed)
    cols: dict[str, list] = {n: [] for n in STEP_SCHEMA.names}
    values: list[float] = []
    token_values: list[np.ndarray] = []
    teacher: list[np.ndarray] = []
    prompt = None
    for i in range(trajectories):
        g = i // group_size
        if i % group_size == 0:
            prompt = rng.integers(0, vocab, rng.integers(prompt_len[0], prompt_len[1] + 1), dtype=np.int32)
            success_rate = rng.uniform(0.05, 0.95)
        n_steps = int(rng.integers(1, max_steps + 1))
        a_lens = rng.integers(action_len[0], action_len[1] + 1, n_steps)
        f_lens = rng.integers(feedback_len[0], feedback_len[1] + 1, n_steps)
        pieces = [prompt]
        for a, f in zip(a_lens, f_lens, strict=True):
            pieces += [rng.integers(0, vocab, a, dtype=np.int32), rng.integers(0, vocab, f, dtype=np.int32)]
        stream = np.concatenate(pieces)
        truncated = n_steps == max_steps and rng.random() < 0.3
        obs_len, prev_end = len(prompt), 0
        for t in range(n_steps):
            a = int(a_lens[t])
            action = stream[obs_len : obs_len + a]
            last = t == n_steps - 1
            n_calls = 0 if last else int(rng.integers(0, 3))
            cols["trajectory_id"].append(f"{id_prefix}-p{g}-s{i % group_size}")
            cols["group_id"].append(f"{id_prefix}-p{g}")
            cols["step_index"].append(t)
            cols["policy_version"].append(policy_version)
            cols["obs_token_ids"].append(stream[:obs_len])
            cols["prefix_len"].append(prev_end)
            cols["action_token_ids"].append(action)
            lp = -rng.exponential(0.7, a).astype(np.float32)
            cols["action_logprobs"].append(lp)
            teacher.append((lp - rng.exponential(0.3, a)).astype(np.float32))
            cols["action_mask"].append((rng.random(a) > 0.02).astype(np.int8))
            cols["feedback"].append("" if last else f"<tool_response>{n_calls} results</tool_response>")
            outcome = float(rng.random() < success_rate) if last and not truncated else 0.0
            cols["reward"].append(outcome if last else 0.0)
            cols["process_reward"].append(rng.choice([-0.1, 0.0, 0.2], n_calls).astype(np.float64))
            cols["done"].append(last)
            cols["truncated"].append(last and truncated)
            cols["finish_reason"].append("length" if last and truncated else "stop")
            cols["info"].append(json.dumps({"anchor_obs": f"state-{g}-{t}-{rng.integers(0, 2)}"}))
            values.append(float(rng.uniform(0.0, 1.0)))
            token_values.append((values[-1] + rng.normal(0, 0.05, a)).astype(np.float32))
            prev_end = obs_len + a
            obs_len = prev_end + int(f_lens[t])
    arrays = []
    for f in STEP_SCHEMA:
        if pa.types.is_list(f.type):
            arrays.append(_lists(cols[f.name], f.type.value_type))
        else:
            arrays.append(pa.array(cols[f.name], type=f.type))
    table = pa.Table.from_arrays(arrays, schema=STEP_SCHEMA)
    table = table.append_column("value", pa.array(values, pa.float64()))
    table = table.append_column("token_values", _lists(token_values, pa.float32()))
    return table.append_column("teacher_logprobs", _lists(teacher, pa.float32()))
