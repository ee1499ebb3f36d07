"""A full disk is the user's to fix, not a bug: every command says so in one line (naming the file
when the error does) and exits 1, also when a second error follows the first (a cleanup, a log line,
a launcher's shutdown written onto the same full disk)."""

from __future__ import annotations

import errno

import pytest

from agent_r1.errors import expected_failure, one_line


def _enospc_from_dev_full() -> OSError:
    """A real ENOSPC: /dev/full answers every write with it."""
    try:
        with open("/dev/full", "w") as f:
            f.write("x")
            f.flush()
    except OSError as e:
        return e
    pytest.fail("/dev/full accepted a write")


def test_a_full_disk_is_an_expected_failure_even_under_a_second_error():
    first = _enospc_from_dev_full()
    assert first.errno == errno.ENOSPC and expected_failure(first) == 1
    assert one_line(first).startswith("no space left on the device (No space left on device)")
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device", "/run/dir/ledger.jsonl")
        except OSError:
            raise ValueError("a cleanup failed too")  # noqa: B904 - the chain is what is tested
    except ValueError as second:
        assert expected_failure(second) == 1
        assert "writing /run/dir/ledger.jsonl" in one_line(
            second
        ) and "run the same command again" in one_line(second)
