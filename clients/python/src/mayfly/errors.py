"""What can go wrong, as exceptions that carry the manager's own message.

Every error the manager answers with is a :class:`MayflyError` whose ``str()`` is the manager's
message (it says what went wrong and what to do) and whose ``status`` is the HTTP status; the
subclasses let a caller catch one kind (``except mayfly.NotFound``). A command that ran and
failed is not an error unless the caller asked for it (``check=True``): then it is a
:class:`CommandError` carrying the :class:`~mayfly.Result`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, Optional, Type

if TYPE_CHECKING:
    from ._api import Result


class MayflyError(Exception):
    """An error from the manager (``status`` is its HTTP status) or from talking to it."""

    def __init__(self, message: str, status: Optional[int] = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


class ManagerUnreachable(MayflyError):
    """The manager's socket cannot be reached, or it hung up before answering."""


class BadRequest(MayflyError):
    """400: the request is wrong (a bad name, an unknown field, a template whose setup failed)."""


class Unauthorized(MayflyError):
    """401 or 403: no token, a revoked one, or one for another sandbox; 403 also for what the
    sandbox may not do (a jailed sandbox's snapshot outside its own directory)."""


class NotFound(MayflyError):
    """404: no such sandbox (said to the admin token only), or no such file in the guest."""


class Conflict(MayflyError):
    """409: the name is taken, the sandbox is dead, its VM is paused, or it has no guest agent
    (or no NIC) for what was asked."""


class OverBudget(MayflyError):
    """429: over the manager's memory budget; pause or delete a sandbox."""


class VMMError(MayflyError):
    """502 (or another 5xx): the sandbox's VMM failed, or did not start or wake."""


class Busy(MayflyError):
    """503: too many requests at once, or the guest agent does not answer yet."""


class TimedOut(MayflyError):
    """504 or a socket timeout: the VM or its agent did not answer in time."""


class CommandError(MayflyError):
    """A command exited non-zero (or was killed) and the caller asked to raise for that."""

    def __init__(self, result: "Result") -> None:
        how = (
            f"exited {result.exit_code}"
            if result.exit_code is not None
            else f"was killed by signal {result.signal}"
        )
        if result.timed_out:
            how += " (its timeout passed)"
        tail = (result.stderr or result.stdout).strip()[-2000:]
        message = f"{result.command!r} {how}"
        if tail:
            message += f": {tail}"
        super().__init__(message)
        self.result = result


_BY_STATUS: Dict[int, Type[MayflyError]] = {
    400: BadRequest,
    401: Unauthorized,
    403: Unauthorized,
    404: NotFound,
    409: Conflict,
    429: OverBudget,
    502: VMMError,
    503: Busy,
    504: TimedOut,
}


def error_for(status: int, message: str) -> MayflyError:
    """The exception for an error answer."""
    kind = _BY_STATUS.get(status)
    if kind is None:
        kind = VMMError if status >= 500 else MayflyError
    return kind(message, status)
