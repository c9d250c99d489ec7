"""Exceptions: one class per dpsync_status (docs/API.md, "Conventions")."""

from __future__ import annotations

import re
from typing import Dict, List, Optional, Tuple, Type


class Error(Exception):
    """A dpsync call failed. ``status`` is the C status without its prefix
    (``"INVALID_ARGUMENT"``), ``code`` its number, ``message`` the library's text
    (``dpsync_last_error()``) or the package's own check, ``function`` the C function (None for
    a check made before any C call). As in C, a failed call changes nothing."""

    status = "UNKNOWN"
    code = -1

    def __init__(self, message: str, function: Optional[str] = None, code: Optional[int] = None) -> None:
        super().__init__(message)
        self.message = message
        self.function = function
        if code is not None and code != type(self).code:
            self.code = code

    def __str__(self) -> str:
        # The library's messages often start with the function's name already.
        where = "%s: " % self.function if self.function and not self.message.startswith(self.function) else ""
        return "%s%s: %s" % (where, self.status, self.message)


class InvalidArgument(Error, ValueError):
    """DPSYNC_STATUS_INVALID_ARGUMENT; also arrays and arguments the package refuses itself."""

    status, code = "INVALID_ARGUMENT", 1


class NotFound(Error):
    """DPSYNC_STATUS_NOT_FOUND: no tensor registered under that name."""

    status, code = "NOT_FOUND", 2


class Conflict(Error):
    """DPSYNC_STATUS_CONFLICT: a name registered again with another role, count, dtype or memory."""

    status, code = "CONFLICT", 3


class Inconsistent(Error):
    """DPSYNC_STATUS_INCONSISTENT: the replicas (or ranks) disagree."""

    status, code = "INCONSISTENT", 4


class InvalidState(Error):
    """DPSYNC_STATUS_INVALID_STATE: not valid now (also: the context was closed)."""

    status, code = "INVALID_STATE", 5


class Unavailable(Error):
    """DPSYNC_STATUS_UNAVAILABLE: CUDA, NCCL or MPI missing at run time or not built in."""

    status, code = "UNAVAILABLE", 6


class BackendError(Error):
    """DPSYNC_STATUS_BACKEND_ERROR: a CUDA, NCCL or MPI call failed."""

    status, code = "BACKEND_ERROR", 7


class Timeout(Error):
    """DPSYNC_STATUS_TIMEOUT: a collective did not complete within the timeout."""

    status, code = "TIMEOUT", 8


class Panic(Error):
    """DPSYNC_STATUS_PANIC: an internal defect; the context refuses further work."""

    status, code = "PANIC", 9


# "rank 3", "ranks 1, 2", "ranks 1 and 2", "ranks 1, 2 and 4" (the numbers, with any commas
# and "and" between them).
_RANKS = re.compile(r"\branks?\s+(\d+(?:\s*(?:,\s*(?:and\s+)?|and\s+)\d+)*)")
_LOST = re.compile(r"\blost\b")


def lost_ranks(message: str) -> Tuple[int, ...]:
    """The ranks a RANK_LOST message names: the numbers of its first "rank N" or "ranks N, M"
    (also "ranks N and M") next to the word "lost" (in the same clause, before or after),
    or else of its first "rank(s) ..." at all; () when it names none."""
    found: List[Tuple[int, ...]] = []
    for m in _RANKS.finditer(message):
        numbers = tuple(int(n) for n in re.findall(r"\d+", m.group(1)))
        before = re.split(r"[;:.]", message[: m.start()])[-1]
        after = re.split(r"[;:.(]", message[m.end() :])[0]
        if _LOST.search(before) or _LOST.search(after):
            return numbers
        found.append(numbers)
    return found[0] if found else ()


class RankLost(Error):
    """DPSYNC_STATUS_RANK_LOST: ranks of an elastic world were lost; this rank's world goes on
    without them, renumbered (docs/API.md, "Elastic worlds"). The GRAD tensors of the call
    that raised it hold unspecified values: compute the step's gradients again and make the
    call again. ``ranks`` is the tuple of lost ranks, by their numbers before the loss, parsed
    from the library's message (``lost_ranks``: its "rank N" or "ranks N, M" text next to the
    word "lost"); () when the message names none."""

    status, code = "RANK_LOST", 10

    def __init__(self, message: str, function: Optional[str] = None, code: Optional[int] = None) -> None:
        super().__init__(message, function, code)
        self.ranks = lost_ranks(message)


BY_CODE: Dict[int, Type[Error]] = {
    cls.code: cls
    for cls in (InvalidArgument, NotFound, Conflict, Inconsistent, InvalidState, Unavailable, BackendError, Timeout, Panic, RankLost)
}


def error_for(code: int, message: str, function: Optional[str] = None) -> Error:
    """The exception for a C status code (an unknown code gives a plain Error)."""
    cls = BY_CODE.get(code, Error)
    return cls(message, function, code)
