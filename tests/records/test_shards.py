import json

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from agent_r1.records.reader import RecordStore, group_hash
from agent_r1.records.shard import (
    ShardError,
    committed_shards,
    finalize_iteration,
    iteration_dir,
    serialize,
    write_shard,
)
from agent_r1.records.synth import synth_table


def _sorted(t):
    return t.take(pc.sort_indices(t, [("trajectory_id", "ascending"), ("step_index", "ascending")]))


@pytest.fixture
def table():
    return synth_table(60, group_size=4, max_steps=5, seed=1, policy_version=7)


@pytest.mark.parametrize("compression", ["zstd", "lz4", "none"])
def test_write_finalize_read_roundtrip(tmp_path, table, compression):
    half = table.num_rows // 2
    m0 = write_shard(tmp_path, 3, 0, table.slice(0, half), compression)
    m1 = write_shard(tmp_path, 3, 1, table.slice(half), compression)
    man = finalize_iteration(tmp_path, 3, expected_writers=2)
    assert man["rows"] == table.num_rows and set(man["shards"]) == {m0.name, m1.name}
    assert man["policy_version_min"] == man["policy_version_max"] == 7
    store = RecordStore(tmp_path)
    assert store.iterations() == [3]
    assert store.read(3).equals(table)
    assert not list(iteration_dir(tmp_path, 3).glob(".*tmp*"))  # no temp files left behind


def test_compression_shrinks(tmp_path, table):
    assert serialize(table, "zstd").size < 0.8 * serialize(table, "none").size


def test_uncompressed_read_is_zero_copy(tmp_path):
    big = synth_table(400, 4, 6, seed=2, prompt_len=(200, 400))
    write_shard(tmp_path, 0, 0, big, "none")
    finalize_iteration(tmp_path, 0)
    store = RecordStore(tmp_path)
    before = pa.total_allocated_bytes()
    t = store.read(0)
    assert t.num_rows == big.num_rows
    # memory-mapped: the columns point into the mapping, nothing copied into Arrow's pool
    assert pa.total_allocated_bytes() - before < 0.01 * big.nbytes


def test_commit_is_idempotent_and_conflicts_are_errors(tmp_path, table):
    m = write_shard(tmp_path, 0, 0, table)
    again = write_shard(tmp_path, 0, 0, table)
    assert again == m and len(committed_shards(tmp_path, 0)) == 1
    with pytest.raises(ShardError, match="already committed with different content"):
        write_shard(tmp_path, 0, 0, table.slice(1))
    man = finalize_iteration(tmp_path, 0)
    assert finalize_iteration(tmp_path, 0) == man
    with pytest.raises(ShardError, match="is finalized"):
        write_shard(tmp_path, 0, 1, table)
    write_shard(tmp_path, 1, 0, table)
    with pytest.raises(ShardError, match="1 shards committed, expected 2"):
        finalize_iteration(tmp_path, 1, expected_writers=2)


def test_schema_checked_before_writing(tmp_path, table):
    with pytest.raises(ValueError, match="unexpected column 'bogus'"):
        write_shard(tmp_path, 0, 0, table.append_column("bogus", pa.array([1] * table.num_rows)))


def _committed(tmp_path, table):
    m = write_shard(tmp_path, 0, 0, table)
    finalize_iteration(tmp_path, 0)
    return RecordStore(tmp_path), iteration_dir(tmp_path, 0) / m.name


def test_truncated_shard_is_reported(tmp_path, table):
    store, path = _committed(tmp_path, table)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ShardError, match=rf"{path.name}: truncated"):
        store.read(0)


def test_corrupt_shard_is_reported(tmp_path, table):
    store, path = _committed(tmp_path, table)
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ShardError, match=rf"{path.name}: checksum mismatch"):
        store.read(0)


def test_unreadable_and_wrong_schema_shards_are_reported(tmp_path, table):
    store, path = _committed(tmp_path, table)
    meta_path = path.with_name(path.name.replace(".arrow", ".meta.json"))
    man_path = path.parent / "manifest.json"

    def replace_file(data: bytes):
        # a file whose metadata matches (as if written by a buggy writer): only the content is wrong
        import xxhash

        path.write_bytes(data)
        man = json.loads(man_path.read_text())
        man["shards"][path.name].update(bytes=len(data), checksum=xxhash.xxh3_64_hexdigest(data))
        man_path.write_text(json.dumps(man))

    replace_file(b"x" * 100)
    with pytest.raises(ShardError, match=rf"{path.name}: not a readable Arrow IPC file"):
        store.read(0)
    other = pa.table({"trajectory_id": ["a"], "reward": [1.0]})
    replace_file(serialize(other, "none").to_pybytes())
    with pytest.raises(ShardError, match=rf"{path.name}: not a step-record table"):
        store.read(0)
    assert meta_path.exists()


def test_missing_shard_and_manifest(tmp_path, table):
    store, path = _committed(tmp_path, table)
    path.unlink()
    with pytest.raises(ShardError, match="missing"):
        store.read(0)
    (path.parent / "manifest.json").write_text("{broken")
    with pytest.raises(ShardError, match="corrupt manifest"):
        store.read(0)
    with pytest.raises(ShardError, match=r"no finalized iteration 4 \(have 0\)"):
        store.manifest(4)
    (path.parent.parent / "iter_000004").mkdir()  # a folder, no manifest yet
    with pytest.raises(ShardError, match="iteration 4 is not finalized"):
        store.manifest(4)


def test_select_by_rank_and_by_group(tmp_path):
    t = synth_table(90, group_size=3, max_steps=4, seed=3)
    n = t.num_rows
    for w, (a, b) in enumerate([(0, n // 3), (n // 3, n // 2), (n // 2, n)]):
        write_shard(tmp_path, 1, w, t.slice(a, b - a))
    finalize_iteration(tmp_path, 1)
    store = RecordStore(tmp_path)
    for by in ("shard", "group"):
        parts = [store.read(1, rank=r, world=2, by=by) for r in range(2)]
        assert sum(p.num_rows for p in parts) == n
        assert _sorted(pa.concat_tables(parts)).equals(_sorted(t))
    g = [set(store.read(1, rank=r, world=2, by="group").column("group_id").to_pylist()) for r in range(2)]
    assert not g[0] & g[1]
    allg = sorted(g[0] | g[1])
    dealt = [x for _, x in sorted(zip(group_hash(allg).tolist(), allg, strict=True))]
    assert g == [set(dealt[0::2]), set(dealt[1::2])]  # hash order, dealt round-robin
    assert abs(len(g[0]) - len(g[1])) <= 1  # balanced
    # as many ranks as groups: every rank gets exactly one (hashing alone leaves ranks empty)
    for world in (2, 3, 5, 8):
        per_rank = [
            store.read(1, rank=r, world=world, by="group").column("group_id").unique() for r in range(world)
        ]
        sizes = sorted(len(x) for x in per_rank)
        assert sizes[-1] - sizes[0] <= 1 and sum(sizes) == len(allg)
    cols = store.read(1, rank=1, world=2, by="group", columns=["trajectory_id", "reward"])
    assert cols.column_names == ["trajectory_id", "reward"]
    with pytest.raises(ValueError, match="rank 2 outside"):
        store.read(1, rank=2, world=2)


def test_damaged_shards_of_an_iteration_to_redo_are_dropped_and_the_intact_ones_kept(tmp_path, table):
    """A resumed run redoes the iterations after its checkpoint: a truncated, corrupt or missing
    shard among their committed ones is removed with its metadata and the iteration's manifest (so
    the worker generates it again), naming the file; intact shards and other iterations stay."""
    from agent_r1.records.shard import committed_shards, drop_damaged_shards, iteration_dir

    half = table.num_rows // 2
    for it in (4, 5):
        write_shard(tmp_path, it, 0, table.slice(0, half), "none")
        write_shard(tmp_path, it, 1, table.slice(half), "none")
        finalize_iteration(tmp_path, it)
    d = iteration_dir(tmp_path, 5)
    assert drop_damaged_shards(tmp_path, 5) == []  # nothing wrong: nothing touched
    data = (d / "shard_w0001.arrow").read_bytes()
    (d / "shard_w0001.arrow").write_bytes(data[: len(data) // 2])  # torn by a crash
    dropped = drop_damaged_shards(tmp_path, 5)
    assert len(dropped) == 1 and "shard_w0001.arrow: truncated" in dropped[0]
    assert [m.name for m in committed_shards(tmp_path, 5)] == ["shard_w0000.arrow"]
    assert not (d / "manifest.json").exists() and (iteration_dir(tmp_path, 4) / "manifest.json").exists()
    (d / "shard_w0000.arrow").write_bytes(b"\0" * (d / "shard_w0000.arrow").stat().st_size)  # same size
    assert "checksum mismatch" in drop_damaged_shards(tmp_path, 5)[0]
    assert committed_shards(tmp_path, 5) == [] and len(committed_shards(tmp_path, 4)) == 2
