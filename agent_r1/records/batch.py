"""Step-record tables <-> the flat tensors the algorithms take.

``to_step_inputs`` orders steps by (trajectory, step index), checks rewards (NaN/inf or an
unscored terminal step is an error naming the trajectory) and builds group / anchor keys that are
stable across processes, so groups spanning shards and ranks line up.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from agent_r1.algos.advantages import Advantages, StepInputs, TokenInputs
from agent_r1.algos.rewards import RewardError, combine_rewards


def stable_key(values: list[str] | list[bytes]) -> np.ndarray:
    """64-bit keys from strings or bytes, identical in every process (unlike ``hash``)."""
    return np.array(
        [
            int.from_bytes(
                hashlib.blake2b(v if isinstance(v, bytes) else v.encode(), digest_size=8).digest(),
                "little",
                signed=True,
            )
            for v in values
        ],
        dtype=np.int64,
    )


def _keys_for(column: pa.ChunkedArray) -> np.ndarray:
    enc = pc.dictionary_encode(column).combine_chunks()
    return stable_key(enc.dictionary.to_pylist())[enc.indices.to_numpy(zero_copy_only=False)]


@dataclass
class StepBatch:
    inputs: StepInputs
    order: np.ndarray  # row i of the sorted batch = row order[i] of the table
    table: pa.Table  # the table, sorted


def _process_sums(col: pa.ChunkedArray, n: int) -> np.ndarray:
    arr = col.combine_chunks()
    flat = pc.list_flatten(arr)
    parents = pc.list_parent_indices(arr).to_numpy()
    vals = flat.fill_null(0.0).to_numpy(zero_copy_only=False)
    if not np.isfinite(vals).all():
        return np.full(n, np.nan)  # reported with the trajectory by the caller
    return np.bincount(parents, weights=vals, minlength=n)


def to_step_inputs(
    table: pa.Table,
    process_coef: float = 1.0,
    tokens: bool = False,
    anchors: bool = False,
) -> StepBatch:
    """Flat step tensors (and, with ``tokens``, flat action-token tensors) of a record table."""
    order = pc.sort_indices(table, [("trajectory_id", "ascending"), ("step_index", "ascending")]).to_numpy()
    table = table.take(pa.array(order))
    n = table.num_rows
    traj_col = table.column("trajectory_id")
    enc = pc.dictionary_encode(traj_col).combine_chunks()
    traj = enc.indices.to_numpy(zero_copy_only=False).astype(np.int64)
    # sorted by id -> contiguous; re-index 0..T-1 in order of appearance
    starts = np.ones(n, dtype=bool)
    starts[1:] = traj[1:] != traj[:-1]
    traj = np.cumsum(starts) - 1
    first = np.flatnonzero(starts)
    ids = traj_col.take(pa.array(first)).to_pylist()

    reward = table.column("reward").to_numpy(zero_copy_only=False).astype(np.float64)  # null -> nan
    done = table.column("done").to_numpy(zero_copy_only=False)
    null = pc.is_null(table.column("reward")).to_numpy(zero_copy_only=False)
    if null[done].any():
        t = ids[traj[np.flatnonzero(null & done)[0]]]
        raise RewardError(f"trajectory {t!r}: terminal step has no reward (unscored)")
    reward = np.where(null, 0.0, reward)
    proc = _process_sums(table.column("process_reward"), n)
    bad = ~np.isfinite(reward) | ~np.isfinite(proc)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise RewardError(
            f"trajectory {ids[traj[i]]!r} step {table.column('step_index')[i].as_py()}: non-finite reward"
        )
    r = combine_rewards(torch.from_numpy(reward), torch.from_numpy(proc), process_coef)
    value = None
    if "value" in table.column_names:
        v = table.column("value").to_numpy(zero_copy_only=False).astype(np.float64)
        if not np.isfinite(v).all():
            raise RewardError(
                f"trajectory {ids[traj[int(np.flatnonzero(~np.isfinite(v))[0])]]!r}: non-finite value"
            )
        value = torch.from_numpy(v)
    group_key = _keys_for(table.column("group_id"))[first]
    anchor = None
    if anchors:  # info.anchor_obs when every step has one, else the observation itself
        texts = [json.loads(s).get("anchor_obs") for s in table.column("info").to_pylist()]
        if all(t is not None for t in texts):
            anchor = stable_key([str(t) for t in texts])
    if anchors and anchor is None:  # identical observation token ids = identical state
        obs = table.column("obs_token_ids").to_numpy(zero_copy_only=False)
        anchor = stable_key([np.asarray(o, dtype=np.int32).tobytes() for o in obs])
    inputs = StepInputs(
        traj=torch.from_numpy(traj),
        group_key=torch.from_numpy(group_key),
        reward=r,
        value=value,
        anchor_key=None if anchor is None else torch.from_numpy(anchor),
    )
    if tokens:
        inputs.tokens = _token_inputs(table)
    return StepBatch(inputs, order, table)


def _flat_list(table: pa.Table, name: str, dtype) -> np.ndarray:
    return pc.list_flatten(table.column(name).combine_chunks()).to_numpy(zero_copy_only=False).astype(dtype)


def _token_inputs(table: pa.Table) -> TokenInputs:
    ids = table.column("action_token_ids").combine_chunks()
    step = pc.list_parent_indices(ids).to_numpy().astype(np.int64)
    out = TokenInputs(
        step=torch.from_numpy(step),
        mask=torch.from_numpy(_flat_list(table, "action_mask", np.int8) != 0),
        logprobs=torch.from_numpy(_flat_list(table, "action_logprobs", np.float64)),
    )
    for name, attr in (("token_values", "values"), ("teacher_logprobs", "teacher_logprobs")):
        if name in table.column_names:
            setattr(out, attr, torch.from_numpy(_flat_list(table, name, np.float64)))
    return out


def with_advantages(batch: StepBatch, adv: Advantages) -> pa.Table:
    """The (sorted) table plus ``advantage``/``return`` or ``token_advantages``/``token_returns``."""
    t = batch.table
    for name in ("advantage", "return", "token_advantages", "token_returns"):
        if name in t.column_names:
            t = t.drop_columns([name])
    if adv.step_adv is not None:
        t = t.append_column("advantage", pa.array(adv.step_adv.numpy(), pa.float64()))
        t = t.append_column("return", pa.array(adv.step_ret.numpy(), pa.float64()))
    if adv.token_adv is not None:
        lengths = pc.list_value_length(t.column("action_token_ids")).to_numpy(zero_copy_only=False)
        offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
        for name, x in (("token_advantages", adv.token_adv), ("token_returns", adv.token_ret)):
            t = t.append_column(
                name, pa.ListArray.from_arrays(offsets, pa.array(x.numpy().astype(np.float32)))
            )
    return t
