"""Errors the driver sees when a worker group call goes wrong.

Every failure of a call on a worker group names the role, the rank and the method, because with
eight workers and three roles "an actor died" tells nobody anything. Three things can go wrong:

- the method raised on a worker: `WorkerMethodError`, carrying the remote traceback as text (the
  original exception object too, when it could be pickled);
- the worker process is gone (killed, OOM, segfault): `WorkerDiedError`; Ray reports the death
  within milliseconds, so this never turns into a wait;
- the call ran past its deadline: `WorkerTimeoutError`, naming the ranks that had not answered.

All derive from `WorkerGroupError`, so a driver can catch one type. `_WorkerSideError` is the
transport form raised inside the worker process (it must pickle with nothing but strings).
"""

from __future__ import annotations


class WorkerGroupError(RuntimeError):
    """A call on a worker group failed; `role`, `rank` and `method` say where."""

    def __init__(self, message: str, *, role: str | None = None, rank: int | None = None, method: str | None = None):
        super().__init__(message)
        self.role = role
        self.rank = rank
        self.method = method


class WorkerMethodError(WorkerGroupError):
    """The worker's method raised. `remote_traceback` is the worker-side traceback (text);
    `remote_exception` the original exception when it survived pickling, else None."""

    def __init__(
        self,
        message: str,
        *,
        role: str | None = None,
        rank: int | None = None,
        method: str | None = None,
        exc_type: str = "",
        remote_traceback: str = "",
        remote_exception: BaseException | None = None,
    ):
        super().__init__(message, role=role, rank=rank, method=method)
        self.exc_type = exc_type
        self.remote_traceback = remote_traceback
        self.remote_exception = remote_exception


class WorkerDiedError(WorkerGroupError):
    """The worker process died (killed, out of memory, crashed) or its __init__ raised."""


class WorkerTimeoutError(WorkerGroupError, TimeoutError):
    """A blocking call did not finish within the worker group's deadline."""


class ResourceUnavailableError(RuntimeError):
    """The Ray cluster lacks the CPUs/GPUs a resource pool asks for."""


class _WorkerSideError(Exception):
    """Raised inside a worker when a registered method fails; unwrapped by the driver.

    Only strings and ints cross the process boundary (plus the original exception when it
    pickles), so an unpicklable user exception cannot hide the real error.
    """

    def __init__(self, rank: int, method: str, exc_type: str, message: str, traceback_text: str, original=None):
        super().__init__(f"rank {rank}: {method}() raised {exc_type}: {message}")
        self.rank = rank
        self.method = method
        self.exc_type = exc_type
        self.message = message
        self.traceback_text = traceback_text
        self.original = original

    def __reduce__(self):
        return (
            _WorkerSideError,
            (self.rank, self.method, self.exc_type, self.message, self.traceback_text, self.original),
        )
