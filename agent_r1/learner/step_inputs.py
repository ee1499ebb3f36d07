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
from agent_r1.algos.step_rewards import RewardError, combine_rewards


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
    order: np.ndarray  # step i of ``inputs`` = row order[i] of the table
    source: pa.Table  # the table as given

    @property
    def identity(self) -> bool:
        return bool((self.order == np.arange(len(self.order))).all())

    @property
    def table(self) -> pa.Table:
        """The table in the order of ``inputs`` (no copy when it was already in that order)."""
        return self.source if self.identity else self.source.take(pa.array(self.order))


def _process_sums(col: pa.ChunkedArray, n: int) -> np.ndarray:
    arr = col.combine_chunks()
    flat = pc.list_flatten(arr)
    parents = pc.list_parent_indices(arr).to_numpy()
    vals = flat.fill_null(0.0).to_numpy(zero_copy_only=False)
    out = np.bincount(parents, weights=vals, minlength=n)
    if not np.isfinite(vals).all():  # reported with the trajectory by the caller
        out[parents[~np.isfinite(vals)]] = np.nan
    return out


def _np(table: pa.Table, name: str) -> np.ndarray:
    return table.column(name).to_numpy(zero_copy_only=False)


def to_step_inputs(
    table: pa.Table, process_coef: float = 1.0, tokens: bool = False, anchors: bool = False
) -> StepBatch:
    """Flat step tensors (and, with ``tokens``, flat action-token tensors) of a record table.

    Steps are grouped by trajectory (in order of first appearance) and ordered by step index; a
    table already in that order (as writers commit it) is used without any copy."""
    n = table.num_rows
    enc = pc.dictionary_encode(table.column("trajectory_id")).combine_chunks()
    codes = enc.indices.to_numpy(zero_copy_only=False).astype(np.int64)
    step_idx = _np(table, "step_index").astype(np.int64)
    in_order = n == 0 or bool(
        ((np.diff(codes) == 0) & (np.diff(step_idx) > 0) | (np.diff(codes) == 1)).all() and codes[0] == 0
    )
    order = np.arange(n) if in_order else np.lexsort((step_idx, codes))
    codes = codes[order]
    starts = np.ones(n, dtype=bool)
    starts[1:] = codes[1:] != codes[:-1]
    traj = np.cumsum(starts) - 1
    first = order[np.flatnonzero(starts)]  # table row of each trajectory's first step
    names = enc.dictionary

    def tid(i: int) -> str:
        return names[int(codes[i])].as_py()

    reward_null = pc.is_null(table.column("reward")).to_numpy(zero_copy_only=False)[order]
    done = _np(table, "done")[order]
    if reward_null[done].any():
        raise RewardError(
            f"trajectory {tid(int(np.flatnonzero(reward_null & done)[0]))!r}: terminal step has no reward (unscored)"
        )
    reward = np.where(reward_null, 0.0, _np(table, "reward")[order].astype(np.float64))
    proc = _process_sums(table.column("process_reward"), n)[order]
    bad = ~np.isfinite(reward) | ~np.isfinite(proc)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise RewardError(f"trajectory {tid(i)!r} step {int(step_idx[order][i])}: non-finite reward")
    value = None
    if "value" in table.column_names:
        v = _np(table, "value")[order].astype(np.float64)
        if not np.isfinite(v).all():
            raise RewardError(
                f"trajectory {tid(int(np.flatnonzero(~np.isfinite(v))[0]))!r}: non-finite value"
            )
        value = torch.from_numpy(v)
    group_key = _keys_for(table.column("group_id"))[first]
    anchor = None
    if anchors:  # info.anchor_obs when every step has one, else the observation itself
        texts = [json.loads(s).get("anchor_obs") for s in table.column("info").to_pylist()]
        if all(t is not None for t in texts):
            anchor = stable_key([str(t) for t in texts])[order]
        else:  # identical observation token ids = identical state
            obs = table.column("obs_token_ids").to_numpy(zero_copy_only=False)
            anchor = stable_key([np.asarray(o, dtype=np.int32).tobytes() for o in obs])[order]
    inputs = StepInputs(
        traj=torch.from_numpy(traj),
        group_key=torch.from_numpy(group_key),
        reward=combine_rewards(torch.from_numpy(reward), torch.from_numpy(proc), process_coef),
        value=value,
        anchor_key=None if anchor is None else torch.from_numpy(anchor),
    )
    batch = StepBatch(inputs, order, table)
    if tokens:
        cols = [
            c
            for c in (
                "action_token_ids",
                "action_mask",
                "action_logprobs",
                "token_values",
                "teacher_logprobs",
            )
            if c in table.column_names
        ]
        t = table.select(cols)
        inputs.tokens = _token_inputs(t if in_order else t.take(pa.array(order)))
    return batch


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
    t = batch.table  # in step order
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
