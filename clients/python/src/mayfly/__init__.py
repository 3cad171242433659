"""A client for ``mayfly serve``: sandboxes by name that run commands, hold files, sleep on
disk when idle, wake on the next request and fork into many.

    import mayfly
    with mayfly.Sandbox.create() as sb:
        print(sb.exec("uname -a").stdout)
        sb.files.write("/root/task.txt", "hello")
        clones = sb.fork(4)

The manager's socket and token come from ``mayfly.Client(sock=..., token=...)`` or, by
default, from ``MAYFLY_SOCK`` and ``MAYFLY_TOKEN`` (or ``MAYFLY_STATE_DIR``'s admin token).
``mayfly.aio`` has the same for asyncio.
"""

from ._api import Entry, Result, Stat, Template
from ._sync import Client, Files, Sandbox, default_client
from .errors import (
    BadRequest,
    Busy,
    CommandError,
    Conflict,
    ManagerUnreachable,
    MayflyError,
    NotFound,
    OverBudget,
    TimedOut,
    Unauthorized,
    VMMError,
)

__version__ = "0.1.0"

__all__ = [
    "BadRequest",
    "Busy",
    "Client",
    "CommandError",
    "Conflict",
    "Entry",
    "Files",
    "ManagerUnreachable",
    "MayflyError",
    "NotFound",
    "OverBudget",
    "Result",
    "Sandbox",
    "Stat",
    "Template",
    "TimedOut",
    "Unauthorized",
    "VMMError",
    "default_client",
]
