"""Synthetic but realistic step records for tests and benchmarks (vectorised: millions of steps).

Groups share a prompt; trajectories have 1..max_steps steps of varying action and feedback length;
observations grow in append mode (``prefix_len`` = previous obs + action); non-terminal steps carry
tool-call process rewards, terminal steps a 0/1 outcome whose rate depends on the group; every step
has a critic value (and per-token values and teacher logprobs); about 2% of action tokens are
masked (forced) and some trajectories at the step limit end truncated.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from agent_r1.records.ragged import ragged_arange
from agent_r1.records.schema import STEP_SCHEMA


def _list_array(values: np.ndarray, lengths: np.ndarray, type_: pa.DataType) -> pa.Array:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if offsets[-1] < 2**31:
        return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values, type=type_))
    return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values, type=type_)).cast(
        pa.list_(type_)
    )


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
    T = trajectories
    traj_group = np.arange(T) // group_size
    G = int(traj_group[-1]) + 1 if T else 0
    success = rng.uniform(0.05, 0.95, G)
    p_len = rng.integers(prompt_len[0], prompt_len[1] + 1, G)
    prompts = rng.integers(0, vocab, p_len.sum(), dtype=np.int32)
    p_start = np.cumsum(p_len) - p_len

    n_steps = rng.integers(1, max_steps + 1, T)
    S = int(n_steps.sum())
    traj = np.repeat(np.arange(T), n_steps)
    step = ragged_arange(n_steps)
    last = step == n_steps[traj] - 1
    a = rng.integers(action_len[0], action_len[1] + 1, S)
    f = rng.integers(feedback_len[0], feedback_len[1] + 1, S)
    # obs length of step t = prompt + sum over earlier steps of (action + feedback)
    af = a + f
    excl = np.cumsum(af) - af
    traj_first = np.cumsum(n_steps) - n_steps
    before = excl - excl[traj_first][traj]
    obs_len = p_len[traj_group][traj] + before
    prefix = np.where(step == 0, 0, np.roll(obs_len + a, 1))

    # each trajectory's token stream: its group's prompt, then action/feedback tokens
    t_len = p_len[traj_group] + np.bincount(traj, weights=af, minlength=T).astype(np.int64)
    t_start = np.cumsum(t_len) - t_len
    stream = rng.integers(0, vocab, t_len.sum(), dtype=np.int32)
    pl = p_len[traj_group]
    stream[np.repeat(t_start, pl) + ragged_arange(pl)] = prompts[
        np.repeat(p_start[traj_group], pl) + ragged_arange(pl)
    ]
    obs_vals = stream[np.repeat(t_start[traj], obs_len) + ragged_arange(obs_len)]
    act_vals = stream[np.repeat(t_start[traj] + obs_len, a) + ragged_arange(a)]

    A = int(a.sum())
    logp = -rng.exponential(0.7, A).astype(np.float32)
    mask = (rng.random(A) > 0.02).astype(np.int8)
    truncated = last & (n_steps[traj] == max_steps) & (rng.random(S) < 0.3)
    outcome = (rng.random(S) < success[traj_group][traj]).astype(np.float64)
    reward = np.where(last & ~truncated, outcome, 0.0)
    n_calls = np.where(last, 0, rng.integers(0, 3, S))
    proc = rng.choice(np.array([-0.1, 0.0, 0.2]), int(n_calls.sum()))
    value = rng.uniform(0.0, 1.0, S)
    tok_values = (np.repeat(value, a) + rng.normal(0, 0.05, A)).astype(np.float32)
    teacher = (logp - rng.exponential(0.3, A)).astype(np.float32)

    traj_names = pa.array([f"{id_prefix}-p{traj_group[i]}-s{i % group_size}" for i in range(T)], pa.string())
    group_names = pa.array([f"{id_prefix}-p{g}" for g in range(G)], pa.string())
    bit = rng.integers(0, 2, S)
    feedback = pc.if_else(
        pa.array(last),
        "",
        pc.binary_join_element_wise(
            "<tool_response>", pc.cast(pa.array(n_calls), pa.string()), " results</tool_response>", ""
        ),
    )
    info = pc.binary_join_element_wise(
        '{"anchor_obs": "state-',
        pc.cast(pa.array(traj_group[traj]), pa.string()),
        "-",
        pc.cast(pa.array(step), pa.string()),
        "-",
        pc.cast(pa.array(bit), pa.string()),
        '"}',
        "",
    )
    cols = {
        "trajectory_id": traj_names.take(pa.array(traj)),
        "group_id": group_names.take(pa.array(traj_group[traj])),
        "step_index": pa.array(step.astype(np.int32)),
        "policy_version": pa.array(np.full(S, policy_version, dtype=np.int64)),
        "obs_token_ids": _list_array(obs_vals, obs_len, pa.int32()),
        "prefix_len": pa.array(prefix.astype(np.int32)),
        "action_token_ids": _list_array(act_vals, a, pa.int32()),
        "action_logprobs": _list_array(logp, a, pa.float32()),
        "action_mask": _list_array(mask, a, pa.int8()),
        "feedback": feedback,
        "reward": pa.array(reward),
        "process_reward": _list_array(proc, n_calls, pa.float64()),
        "done": pa.array(last),
        "truncated": pa.array(truncated),
        "finish_reason": pc.if_else(pa.array(truncated), "length", "stop"),
        "info": info,
    }
    table = pa.Table.from_arrays([cols[f.name].cast(f.type) for f in STEP_SCHEMA], schema=STEP_SCHEMA)
    table = table.append_column("value", pa.array(value))
    table = table.append_column("token_values", _list_array(tok_values, a, pa.float32()))
    return table.append_column("teacher_logprobs", _list_array(teacher, a, pa.float32()))
