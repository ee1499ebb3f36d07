"""Checkpoint integrity helpers and the non-finite record filter, on hand-made files and tables."""

from __future__ import annotations

import contextlib
import errno
import math
import os
import subprocess

import pyarrow as pa
import pytest
import torch

from agent_r1.learner.batch import drop_nonfinite
from agent_r1.learner.checkpoint_files import (
    CheckpointError,
    first_nonfinite,
    no_space,
    no_space_error,
    verify_checksums,
    write_checksums,
)


def _ckpt(tmp_path):
    d = tmp_path / "iter_000001"
    (d / "sub").mkdir(parents=True)
    (d / "__0_0.distcp").write_bytes(bytes(range(256)) * 64)
    (d / "sub" / "common.pt").write_bytes(b"abc")
    (d / "agent_r1_state.json").write_text("{}")
    write_checksums(d)
    return d


def test_checksums_pass_on_the_files_as_written(tmp_path):
    verify_checksums(_ckpt(tmp_path))


def test_a_changed_byte_names_the_file(tmp_path):
    d = _ckpt(tmp_path)
    with (d / "__0_0.distcp").open("r+b") as f:
        f.seek(100)
        f.write(b"\x00\x00\xc0\x7f")
    with pytest.raises(CheckpointError, match=r"__0_0.distcp does not match its checksum"):
        verify_checksums(d)


def test_a_missing_file_is_named(tmp_path):
    d = _ckpt(tmp_path)
    (d / "sub" / "common.pt").unlink()
    with pytest.raises(CheckpointError, match=r"sub/common.pt is missing"):
        verify_checksums(d)


def test_a_checkpoint_without_checksums_is_accepted(tmp_path):
    d = _ckpt(tmp_path)
    (d / "checksums.json").unlink()
    verify_checksums(d)  # written before checksums existed: loaded (with a warning)


def test_first_nonfinite():
    ok = [("a", torch.ones(3)), ("ids", torch.tensor([1, 2]))]
    assert first_nonfinite(ok) is None
    assert (
        first_nonfinite([*ok, ("b", torch.tensor([0.0, math.nan])), ("c", torch.tensor([math.inf]))]) == "b"
    )
    assert first_nonfinite([("c", torch.tensor([-math.inf], dtype=torch.bfloat16))]) == "c"


def test_no_space_is_found_through_wrapping_exceptions(tmp_path):
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as inner:
            raise RuntimeError("checkpointing failed") from inner
    except RuntimeError as e:
        assert no_space(e)
        err = no_space_error(tmp_path / "iter_000003.tmp", e)
    assert err.errno == errno.ENOSPC and "no space left on device writing" in str(err)
    assert "MiB free" in str(err)
    assert not no_space(RuntimeError("other")) and not no_space(OSError(errno.EACCES, "denied"))


def test_trajectories_with_nonfinite_numbers_are_dropped_whole():
    t = pa.table(
        {
            "trajectory_id": ["a", "a", "b", "c", "c", "d"],
            "action_logprobs": [[-0.1, -0.2], [-0.3], [-0.5, math.nan], [-0.1], [-0.2], [-0.4]],
            "reward": [None, 1.0, 0.0, None, 1.0, math.inf],
        }
    )
    kept, dropped = drop_nonfinite(t)
    assert dropped == 2  # b (NaN logprob), d (infinite reward); c keeps both its steps
    assert kept.column("trajectory_id").to_pylist() == ["a", "a", "c", "c"]
    same, none = drop_nonfinite(kept)
    assert none == 0 and same.num_rows == 4


@pytest.fixture
def full_fs(tmp_path):
    """A 4 MiB tmpfs filled to the last byte (root only: mount)."""
    mnt = tmp_path / "full"
    mnt.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)]).returncode
    ):
        pytest.skip("mounting a small tmpfs needs root")
    try:
        with open(mnt / "ballast", "wb") as f:
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
        yield mnt
    finally:
        subprocess.run(["umount", "--lazy", str(mnt)], check=True)  # a failed write may hold a file open


def test_a_write_that_fails_on_a_full_disk_is_no_space_even_without_its_errno(full_fs, tmp_path):
    """torch's checkpoint writer loses the errno of a full disk (its C++ stream says
    ``basic_ios::clear: iostream error`` or ``unexpected pos``): a failed write with almost nothing
    free where it wrote is a full disk all the same; elsewhere the error stands as it is."""
    with pytest.raises(Exception) as raised:
        torch.save({"w": torch.ones(1 << 20)}, full_fs / "shard.pt")
    lost = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    assert no_space(raised.value, full_fs / "iter_000003.tmp") and no_space(lost, full_fs / "iter_000003.tmp")
    assert not no_space(lost, tmp_path / "iter_000003.tmp") and not no_space(lost)
    err = no_space_error(full_fs / "iter_000003.tmp", lost)
    assert err.errno == errno.ENOSPC and "unexpected pos 704 vs 598" in str(err)
