"""``LearnerBatch``: one rank's share of an iteration as flat columns, built once from the Arrow table.

Everything the learner does with an iteration's records indexes into it:

- steps (S,) in (trajectory, step index) order, with ``traj_steps`` (T + 1,) offsets per trajectory;
- action tokens (A,) flat in that order, with ``act_offsets`` (S + 1,) per step: rollout logprobs,
  action mask, teacher logprobs; the learner's logprobs and token advantages come back in this
  order too;
- the prefix-merged token stream of every trajectory (docs/architecture.md): a step whose observation starts
  with the previous step's observation + action continues the previous step's sequence, so a
  T-step trajectory is one sequence over its unique tokens. ``label_pos`` (A,) says where each
  action token sits in the stream, ``value_pos`` (S,) where each step starts (its last
  observation token).

Images (Qwen2-VL family): a sequence's images are those of its last step's observation (it shows
every earlier one); its positions are then the three multimodal rotary rows (``stream_positions``
(3, N)), and a micro-batch carries its sequences' images for the vision tower.

The stream is computed once with vector operations; a micro-batch (``Packed``) is an index
gather of whole trajectories from it, so the old-logprob, reference, value and every optimizer
pass reuse the same plan. Host-side index arithmetic stays in numpy; the tensors a micro-batch
and the flat targets hand to the model live on the learner's device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from agent_r1.algos.advantages import StepInputs
from agent_r1.learner.packing import Packed, balanced_bins, first_fit_decreasing
from agent_r1.learner.step_inputs import to_step_inputs
from agent_r1.records.ragged import ragged_arange
from agent_r1.records.schema import table_images
from agent_r1.vision.images import Image
from agent_r1.vision.qwen2_vl import Geometry

NUMERIC_COLUMNS = ("action_logprobs", "reward", "teacher_logprobs")  # what a non-finite value poisons


def drop_nonfinite(table: pa.Table) -> tuple[pa.Table, int]:
    """The table without every trajectory that has a NaN / infinite logprob or reward in any step
    (a broken server or corrupted weights produce them; training on them would spread NaN into
    the weights), and how many trajectories were dropped."""
    bad = None
    for name in NUMERIC_COLUMNS:
        if name not in table.column_names:
            continue
        col = table.column(name)
        if pa.types.is_list(col.type):
            flat = pc.list_flatten(col)
            rows = pc.list_parent_indices(col)
            flat_bad = pc.invert(pc.is_finite(flat))
            row_bad = np.zeros(table.num_rows, dtype=bool)
            row_bad[np.asarray(rows)[np.asarray(flat_bad.fill_null(False))]] = True
        else:
            row_bad = ~np.asarray(pc.is_finite(col).fill_null(True))
        bad = row_bad if bad is None else bad | row_bad
    if bad is None or not bad.any():
        return table, 0
    trajs = table.column("trajectory_id")
    bad_ids = pc.unique(pc.filter(trajs, pa.array(bad)))
    keep = pc.invert(pc.is_in(trajs, value_set=bad_ids))
    return table.filter(keep), len(bad_ids)


def ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """concat(arange(s, s + n) for s, n in zip(starts, lengths))."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return np.repeat(np.asarray(starts, dtype=np.int64), lengths) + ragged_arange(lengths)


def _exclusive_cumsum(x: np.ndarray) -> np.ndarray:
    out = np.zeros(len(x) + 1, dtype=np.int64)
    np.cumsum(x, out=out[1:])
    return out


def _flat(column: pa.ChunkedArray, dtype) -> tuple[np.ndarray, np.ndarray]:
    """A list column -> (flat values, (rows + 1,) offsets)."""
    arr = column.combine_chunks()
    lengths = pc.list_value_length(arr).to_numpy(zero_copy_only=False).astype(np.int64)
    values = pc.list_flatten(arr).to_numpy(zero_copy_only=False).astype(dtype)  # a writable copy
    return values, _exclusive_cumsum(lengths)


@dataclass
class LearnerBatch:
    table: pa.Table  # the records, in step order
    inputs: StepInputs  # the advantage estimators' flat inputs (host, float64), same order
    device: torch.device
    traj_steps: np.ndarray  # (T + 1,) step offsets of each trajectory
    act_offsets: np.ndarray  # (S + 1,) action-token offsets of each step
    versions: np.ndarray  # (S,) policy version that sampled each step
    # flat per action token (A,), on ``device``
    action_mask: torch.Tensor  # bool, False = not sampled by the policy (never trained on)
    rollout_logprobs: torch.Tensor  # float32, as sampled by the engine
    teacher_logprobs: torch.Tensor | None  # float32 (OPD)
    # the prefix-merged stream (host)
    stream_tokens: np.ndarray  # (N,) int64
    stream_positions: np.ndarray  # (N,) int64, restart at 0 per sequence; (3, N) with images
    label_pos: np.ndarray  # (A,) stream index of each action token
    value_pos: np.ndarray  # (S,) stream index of each step's last observation token
    traj_tokens: np.ndarray  # (T + 1,) stream offsets of each trajectory
    step_of_token: np.ndarray  # (A,) step of each action token
    trainable_per_step: np.ndarray  # (S,) action tokens with mask 1 in each step
    seq_starts: np.ndarray  # (sequences + 1,) stream offsets of the packed sequences
    seq_images: list[list[Image]] | None = None  # each sequence's images (None: no images)
    stream_is_image: np.ndarray | None = None  # (N,) bool: the image pads of the observations
    _plans: dict[tuple[bytes, int], list[Packed]] = field(default_factory=dict, repr=False)

    # ---- construction -----------------------------------------------------------------------------
    @classmethod
    def from_table(
        cls,
        table: pa.Table,
        device: torch.device | str = "cpu",
        process_coef: float = 1.0,
        tokens: bool = False,
        anchors: bool = False,
        vision: Geometry | None = None,
    ) -> LearnerBatch:
        """Order the records (``to_step_inputs``: trajectories by first appearance, steps by index;
        reward checks), then build the flat columns and the merged stream. ``vision``: the
        model's image geometry, which records with images need."""
        sb = to_step_inputs(table, process_coef, tokens=tokens, anchors=anchors)
        t = sb.table
        traj = sb.inputs.traj.numpy()
        S = len(traj)
        first = np.ones(S, dtype=bool)
        first[1:] = traj[1:] != traj[:-1]
        traj_steps = np.append(np.flatnonzero(first), S).astype(np.int64)
        obs, obs_off = _flat(t.column("obs_token_ids"), np.int64)
        act, act_off = _flat(t.column("action_token_ids"), np.int64)
        obs_len, act_len = np.diff(obs_off), np.diff(act_off)
        prefix = t.column("prefix_len").to_numpy(zero_copy_only=False).astype(np.int64)
        # a step continues the previous one's sequence when its obs starts with prev obs + action
        prev_end = np.concatenate([[-1], obs_len[:-1] + act_len[:-1]])
        merged = ~first & (prefix == prev_end) & (prefix > 0)
        skip = np.where(merged, prefix, 0)
        new_obs = obs_len - skip
        if (new_obs[~merged] == 0).any():
            i = int(np.flatnonzero(~merged & (new_obs == 0))[0])
            raise ValueError(
                f"trajectory {t.column('trajectory_id')[i].as_py()!r} step "
                f"{t.column('step_index')[i].as_py()}: empty observation"
            )
        step_start = _exclusive_cumsum(new_obs + act_len)
        n = int(step_start[-1])
        act_start = step_start[:-1] + new_obs
        tok = np.empty(n, dtype=np.int64)
        tok[ranges(step_start[:-1], new_obs)] = obs[ranges(obs_off[:-1] + skip, new_obs)]
        label_pos = ranges(act_start, act_len)
        tok[label_pos] = act
        seq_start = np.zeros(n, dtype=bool)
        seq_start[step_start[:-1][~merged]] = True
        starts = np.flatnonzero(seq_start)
        positions = np.arange(n, dtype=np.int64) - starts[np.cumsum(seq_start) - 1]
        seq_starts = np.append(starts, n).astype(np.int64)
        seq_images = _sequence_images(t, merged, vision)
        is_image = None
        if seq_images is not None:  # image pads are observation tokens (a sampled pad is text)
            is_image = tok == vision.image_token_id
            is_image[label_pos] = False
            positions = _multimodal_positions(tok, seq_starts, seq_images, vision, is_image)
        mask, _ = _flat(t.column("action_mask"), np.int8)
        lp, _ = _flat(t.column("action_logprobs"), np.float32)
        teacher = None
        if "teacher_logprobs" in t.column_names:
            teacher = torch.from_numpy(_flat(t.column("teacher_logprobs"), np.float32)[0]).to(device)
        return cls(
            table=t,
            inputs=sb.inputs,
            device=torch.device(device),
            traj_steps=traj_steps,
            act_offsets=act_off,
            versions=t.column("policy_version").to_numpy(zero_copy_only=False).astype(np.int64),
            action_mask=torch.from_numpy(mask != 0).to(device),
            rollout_logprobs=torch.from_numpy(lp).to(device),
            teacher_logprobs=teacher,
            stream_tokens=tok,
            stream_positions=positions,
            label_pos=label_pos,
            value_pos=act_start - 1,
            traj_tokens=np.append(step_start[traj_steps[:-1]], n).astype(np.int64),
            step_of_token=np.repeat(np.arange(S, dtype=np.int64), act_len),
            trainable_per_step=np.diff(_exclusive_cumsum(mask != 0)[act_off]),
            seq_starts=seq_starts,
            seq_images=seq_images,
            stream_is_image=is_image,
        )

    # ---- sizes ------------------------------------------------------------------------------------
    @property
    def num_trajectories(self) -> int:
        return len(self.traj_steps) - 1

    @property
    def num_steps(self) -> int:
        return int(self.traj_steps[-1])

    @property
    def num_action_tokens(self) -> int:
        return int(self.act_offsets[-1])

    @property
    def num_stream_tokens(self) -> int:
        """Tokens one forward over the whole batch costs after prefix merging."""
        return int(self.traj_tokens[-1])

    def steps_of(self, trajectories: np.ndarray) -> np.ndarray:
        """(S_sel,) step rows of the given trajectories, in order."""
        return ranges(self.traj_steps[trajectories], np.diff(self.traj_steps)[trajectories])

    def tokens_of(self, trajectories: np.ndarray) -> np.ndarray:
        """(A_sel,) action-token indices of the given trajectories, in order."""
        first = self.act_offsets[self.traj_steps[trajectories]]
        last = self.act_offsets[self.traj_steps[trajectories + 1]]
        return ranges(first, last - first)

    def per_token(self, step_values: torch.Tensor) -> torch.Tensor:
        """(S,) per-step values broadcast to their action tokens: (A,)."""
        idx = torch.from_numpy(self.step_of_token).to(step_values.device)
        return step_values[idx]

    # ---- micro-batches ----------------------------------------------------------------------------
    def micro_batches(
        self,
        trajectories: np.ndarray | None,
        max_tokens: int,
        cache: bool = True,
        pad_to: int = 1,
        count: int | None = None,
        share_prefix: int = 0,
    ) -> list[Packed]:
        """The given trajectories (all when None) as packed micro-batches of at most ``max_tokens``
        tokens (first-fit decreasing in the given order; a longer trajectory gets one of its
        own). With ``cache`` the same selection returns the same plan (the old-logprob,
        reference, value and policy passes over one selection share it). ``pad_to``: each
        micro-batch's stream is padded to a multiple of it (FP8 GEMMs need 16) by one padding
        sequence of its own: attended by nothing real, no label, no value, in no denominator.
        ``count``: more micro-batches than the budget needs, exactly that many (balanced).
        ``share_prefix`` > 0: a trajectory whose first observation starts with at least that many
        tokens of an earlier member's (its group's prompt; a shared system prompt) shares those
        rows instead of repeating them (``_share``); a group's trajectories are binned together."""
        if pad_to < 1:
            raise ValueError(f"pad_to must be >= 1, got {pad_to}")
        sel = np.arange(self.num_trajectories) if trajectories is None else np.asarray(trajectories, np.int64)
        key = (sel.tobytes(), max_tokens, pad_to, count, share_prefix)
        if key in self._plans:
            return self._plans[key]
        lens = np.diff(self.traj_tokens)
        units, lengths = [[i] for i in sel.tolist()], lens[sel].tolist()
        if share_prefix and self.seq_images is None:
            units, lengths = self._units(sel, max_tokens)
        bins = first_fit_decreasing(lengths, max_tokens)
        if count is not None and count > len(bins):
            if count > len(units):  # more micro-batches than groups: trajectories binned one by one
                units, lengths = [[i] for i in sel.tolist()], lens[sel].tolist()
            bins = balanced_bins(lengths, count)
        members = [np.sort(np.concatenate([units[k] for k in b]).astype(np.int64)) for b in bins]
        plan = [self._gather(m, pad_to, share_prefix if self.seq_images is None else 0) for m in members]
        if cache:
            self._plans[key] = plan
        return plan

    def _prompt(self, t: int) -> np.ndarray:
        """Trajectory ``t``'s first observation (the stream rows before its first action token)."""
        a = int(self.traj_tokens[t])
        return self.stream_tokens[a : int(self.value_pos[self.traj_steps[t]]) + 1]

    def _units(self, sel: np.ndarray, max_tokens: int) -> tuple[list[list[int]], list[int]]:
        """The selection as binning units and their stream tokens: each group's trajectories
        together (they share its prompt: a member adds what it does not share with the unit's
        first one), split where a unit would outgrow ``max_tokens``."""
        gid = self.table.column("group_id").to_numpy(zero_copy_only=False)[self.traj_steps[sel]]
        lens = np.diff(self.traj_tokens)
        chunks: dict[str, list[list[int]]] = {}
        sizes: dict[str, list[int]] = {}
        for t, g in zip(sel.tolist(), gid.tolist(), strict=True):
            units, used = chunks.setdefault(g, [[]]), sizes.setdefault(g, [0])
            add = int(lens[t]) - (_common(self._prompt(units[-1][0]), self._prompt(t)) if units[-1] else 0)
            if units[-1] and used[-1] + add > max_tokens:
                units.append([])
                used.append(0)
                add = int(lens[t])
            units[-1].append(t)
            used[-1] += add
        return [u for g in chunks for u in chunks[g]], [n for g in sizes for n in sizes[g]]

    def _share(self, members: np.ndarray, share_prefix: int) -> tuple[np.ndarray, np.ndarray]:
        """For each member, the earlier member (a root: one that shares nothing) whose first
        observation it continues, and how many rows it shares (-1 and 0: none, it is a root). The
        longest common prefix with any root, if at least ``share_prefix`` tokens."""
        root = np.full(len(members), -1, dtype=np.int64)
        shared = np.zeros(len(members), dtype=np.int64)
        roots: list[tuple[int, np.ndarray]] = []
        exact: dict[bytes, int] = {}
        for k, t in enumerate(members.tolist()):
            p = self._prompt(t)
            hit = exact.get(p.tobytes())
            best = (len(p), hit) if hit is not None else (0, -1)
            if hit is None:
                for r, rp in roots:
                    c = _common(p, rp)
                    if c > best[0]:
                        best = (c, r)
            if best[0] >= share_prefix and best[1] >= 0:
                root[k], shared[k] = best[1], best[0]
            else:
                roots.append((k, p))
                exact.setdefault(p.tobytes(), k)
        return root, shared

    def _gather(self, members: np.ndarray, pad_to: int = 1, share_prefix: int = 0) -> Packed:
        """One micro-batch: the member trajectories' stream segments back to back (then padding);
        with ``share_prefix`` a member that shares a root's first rows leaves them out, and its
        first sequence continues the root's (``Packed.parents``)."""
        t0, t1 = self.traj_tokens[members], self.traj_tokens[members + 1]
        root, cut = (
            self._share(members, share_prefix) if share_prefix else (None, np.zeros(len(members), np.int64))
        )
        lens = t1 - t0 - cut
        tok_idx = ranges(t0 + cut, lens)
        mb_start = _exclusive_cumsum(lens)[:-1]
        shift = mb_start - t0 - cut  # stream index -> micro-batch index (of a member's own rows)
        steps = self.steps_of(members)
        n_steps = np.diff(self.traj_steps)[members]
        acts = self.tokens_of(members)
        n_acts = self.act_offsets[self.traj_steps[members + 1]] - self.act_offsets[self.traj_steps[members]]
        local_step = self.step_of_token[acts] - np.repeat(
            self.traj_steps[members] - _exclusive_cumsum(n_steps)[:-1], n_acts
        )
        positions = self.stream_positions[..., tok_idx]
        # the member sequences: those starting inside the members' token ranges, in order
        first = np.searchsorted(self.seq_starts, t0)
        last = np.searchsorted(self.seq_starts, t1)
        seqs = ranges(first, last - first)
        seq_lens = np.diff(self.seq_starts)[seqs]
        parents = None
        if root is not None and cut.any():  # a sharing member's first sequence: a branch of its root's
            firsts = _exclusive_cumsum(last - first)[:-1]
            seq_lens[firsts] -= cut
            parents = [(0, 0)] * len(seqs)
            for k in np.flatnonzero(cut).tolist():
                parents[int(firsts[k])] = (int(mb_start[root[k]]), int(cut[k]))
        cu = _exclusive_cumsum(seq_lens)
        tokens = self.stream_tokens[tok_idx]
        pad = -len(tokens) % pad_to
        if pad:  # one more sequence, of padding: its own segment, positions from 0
            seq_lens = np.append(seq_lens, pad)
            parents = None if parents is None else [*parents, (0, 0)]
            cu = _exclusive_cumsum(seq_lens)
            tokens = np.concatenate([tokens, np.full(pad, PAD_TOKEN, tokens.dtype)])
            fill = np.broadcast_to(np.arange(pad, dtype=positions.dtype), (*positions.shape[:-1], pad))
            positions = np.concatenate([positions, fill], axis=-1)
        seq_id = np.repeat(np.arange(len(seq_lens)), seq_lens)

        def dev(x: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(x)).to(self.device)

        images: list[Image] = []
        image_pos = None
        if self.seq_images is not None:
            images = [im for s in seqs.tolist() for im in self.seq_images[s]]
            image_pos = dev(np.flatnonzero(self.stream_is_image[tok_idx])) if images else None
        act_index = dev(acts)
        label_pos = self.label_pos[acts] + np.repeat(shift, n_acts)
        value_pos = self._rows_in(self.value_pos[steps], members, n_steps, root, cut, mb_start, shift)
        pred_pos = None
        if parents is not None:  # a row a member left out is its root's row at the same place
            pred_pos = self._rows_in(self.label_pos[acts] - 1, members, n_acts, root, cut, mb_start, shift)
        packed = Packed(
            tokens=dev(tokens),
            positions=dev(positions),
            seq_id=dev(seq_id),
            cu_seqlens=dev(cu),
            label_pos=dev(label_pos),
            label_step=dev(local_step),
            label_mask=self.action_mask[act_index],
            num_steps=len(steps),
            step_value_pos=dev(value_pos),
            act_index=act_index,
            step_index=dev(steps),
            bounds=list(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)),
            trajectories=members,
            images=images,
            image_pos=image_pos,
            parents=parents,
            pred_pos=None if pred_pos is None else dev(pred_pos),
        )
        # the host arrays a context-parallel split reads (no device round trip; a dry run's
        # device tensors hold no values)
        packed.cache["host"] = {
            "tokens": tokens,
            "positions": positions,
            "label_pos": label_pos,
            "value_pos": value_pos,
        }
        return packed

    def _rows_in(self, pos, members, counts, root, cut, mb_start, shift) -> np.ndarray:
        """Stream rows of the members (``counts`` of each, in member order) -> micro-batch rows; a
        row inside a member's shared prefix is its root's row at the same offset."""
        own = pos + np.repeat(shift, counts)
        if root is None or not cut.any():
            return own
        off = pos - np.repeat(self.traj_tokens[members], counts)
        k_cut = np.repeat(cut, counts)
        k_root_start = np.repeat(mb_start[np.maximum(root, 0)], counts)
        return np.where(off < k_cut, k_root_start + off, own)


def _common(a: np.ndarray, b: np.ndarray) -> int:
    """The length of the common prefix of two token arrays."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


PAD_TOKEN = 0  # the id a padding sequence holds: never a label, so any id in the vocabulary does


def _sequence_images(t: pa.Table, merged: np.ndarray, vision: Geometry | None) -> list[list[Image]] | None:
    """Each packed sequence's images: those of its last step's observation; None without images."""
    if "images" not in t.column_names:
        return None
    refs = t.column("images").to_pylist()
    if not any(refs):
        return None
    if vision is None:
        raise ValueError("the records carry images but the model is text-only (no image geometry)")
    try:
        stored = table_images(t)
    except ValueError as e:
        raise ValueError(f"records: {e}") from None
    tids = t.column("trajectory_id").to_pylist()
    cache: dict[str, Image] = {}

    def image(tid: str, h: str) -> Image:
        if h not in cache:
            cache[h] = Image.from_bytes(bytes(stored[(tid, h)]), f"image {h[:12]} of trajectory {tid}")
        return cache[h]

    last = np.append(np.flatnonzero(~merged)[1:] - 1, len(refs) - 1)  # each sequence's last step
    return [[image(tids[s], h) for h in refs[s] or []] for s in last.tolist()]


def _multimodal_positions(
    tok: np.ndarray,
    seq_starts: np.ndarray,
    seq_images: list[list[Image]],
    vision: Geometry,
    is_image: np.ndarray,
) -> np.ndarray:
    """(3, N) rotary positions of the stream: each sequence laid out as the model lays out its
    prompt (a sequence without images: the same count on all three rows)."""
    out = np.empty((3, len(tok)), dtype=np.int64)
    for s, images in enumerate(seq_images):
        a, b = int(seq_starts[s]), int(seq_starts[s + 1])
        if images:
            try:
                out[:, a:b] = vision.positions(tok[a:b], images, is_image[a:b])[0]
            except ValueError as e:
                raise ValueError(f"packed sequence {s} (stream tokens {a}..{b}): {e}") from None
        else:
            out[:, a:b] = np.arange(b - a)
    return out
