"""Expected failures, and how a command reports them.

An expected failure is the user's to fix: a bad argument or config value, a missing or damaged
file, an unreachable server. Its exception class derives from ``AgentR1Error`` (beside the builtin
it always was: ``ShardError`` is still a ``ValueError``), its message names what is wrong and where,
and ``agent-r1`` prints that message as one line and exits with ``exit_code`` (2: usage, 1: runtime).
Any other exception is a bug and keeps its traceback; ``agent-r1 --debug ...`` shows one for every
failure.
"""

from __future__ import annotations

import errno


class AgentR1Error(Exception):
    """A runtime failure the user can fix; the message says what and where."""

    exit_code = 1


class UsageError(AgentR1Error):
    """A bad argument, flag or config value."""

    exit_code = 2


class RoleTimeout(TimeoutError):
    """Another role of a run (a server, a worker, the coordinator) did not answer in time; the
    message says which and where to look."""


def expected_failure(e: BaseException) -> int | None:
    """The exit code for an expected failure, None for a bug. Besides ``AgentR1Error``: an OS error
    about a path (missing, a directory, no permission) and a connection that failed."""
    if isinstance(e, AgentR1Error):
        return e.exit_code
    if full_disk(e) is not None:
        return 1  # whatever was being written when the disk filled (or a cleanup after it)
    if isinstance(e, FileNotFoundError | IsADirectoryError | NotADirectoryError | PermissionError):
        return 1  # a path the user gave; the message or the filename names it
    if isinstance(e, OSError) and (e.filename is not None or isinstance(e, ConnectionError | TimeoutError)):
        return 1
    return None


def one_line(e: BaseException) -> str:
    """The message of an expected failure as the user reads it."""
    full = full_disk(e)
    if full is not None:
        where = f" writing {full.filename}" if full.filename else ""
        return (
            f"no space left on the device{where} ({full.strerror}): free space there and run the same "
            "command again (a run resumes from its last checkpoint)"
        )
    if isinstance(e, OSError) and e.filename is not None and e.strerror:
        return f"{e.filename}: {e.strerror}"
    return str(e).strip() or type(e).__name__


def full_disk(e: BaseException | None) -> OSError | None:
    """The ENOSPC / EDQUOT error in ``e``'s chain (the one that carries a file name, if any)."""
    seen, found = set(), None
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            if found is None or (found.filename is None and e.filename is not None):
                found = e
        e = e.__cause__ or e.__context__
    return found


__all__ = ["AgentR1Error", "UsageError", "expected_failure", "full_disk", "one_line"]
