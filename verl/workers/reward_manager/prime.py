"""Reward manager that scores samples in parallel worker processes, each with a time limit.

For reward functions that are slow or may hang on adversarial responses (symbolic math checkers,
running generated code): samples are spread over a process pool and a sample whose scoring takes longer
than ``timeout`` seconds scores 0, flagged in ``reward_extra_info["reward_timeout"]`` (and
``"reward_error"``). A timeout is a property of the response, so it never raises, whatever ``on_error``.

How the limit is enforced, twice:

- inside the worker, a ``SIGALRM`` timer interrupts ``compute_score`` after ``timeout`` seconds, which
  stops any pure-Python computation and frees the worker for the next sample;
- in the parent, a batch deadline (``timeout`` per round of samples per worker, plus a margin) catches
  code the signal cannot interrupt (a long C call); the pool is then terminated, killing stuck workers.

Workers are forked (where the platform allows) after the scoring function is stored, so it is never
pickled: closures and functions from files loaded with ``custom_reward_function.path`` work. Only the
samples' inputs and results cross the process boundary; an exception is returned as its message.

``parallel_compute_score_async`` (and its blocking form ``run_reward_scoring``) is upstream's functional
entry to the same pool: ``evaluation_func(task, completion, reference, extra_info)`` for each row, each
within ``timeout``; a row that fails or times out scores 0.0, as upstream.
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing
import os
import signal
import time
from collections.abc import Callable

from verl.workers.reward_manager.abstract import AbstractRewardManager, Sample, ScoreOutcome
from verl.workers.reward_manager.registry import register

_DEADLINE_MARGIN_S = 5.0
_worker_fn: Callable | None = None


class _SampleTimeout(Exception):
    pass


def _on_alarm(signum, frame):
    raise _SampleTimeout


def _init_worker(fn: Callable) -> None:
    global _worker_fn
    _worker_fn = fn
    signal.signal(signal.SIGALRM, _on_alarm)
    # A forked worker inherits the parent's SIGTERM handler: inside a Ray process (the TaskRunner, or
    # any driver after ray.init) that is Ray's failure handler, under which `Pool.terminate()`'s
    # SIGTERM leaves a worker alive and the parent's join hangs forever. SIGTERM arrives blocked
    # (see `_fork_pool`), so one sent before this line waits and then kills with the default action.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


def _fork_pool(num_workers: int, fn: Callable):
    """A pool whose workers start with SIGTERM blocked (the mask of the forking thread, and of the
    pool's own threads, which fork replacements), until `_init_worker` makes its action the default:
    `Pool.terminate()` may signal a worker that is still starting up."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        return _pool_context().Pool(num_workers, initializer=_init_worker, initargs=(fn,))
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _score_in_worker(kwargs: dict, timeout: float, args: tuple = ()) -> tuple[str, object]:
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        return "ok", _worker_fn(*args, **kwargs)
    except _SampleTimeout:
        return "timeout", None
    except Exception as e:
        return "error", f"{type(e).__name__}: {e}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def _run_in_pool(fn: Callable, calls: list[tuple[tuple, dict]], num_processes: int, timeout: float) -> list:
    """[(status, value)] of `fn(*args, **kwargs)` per call, in a fresh pool of at most `num_processes`
    workers, each call within `timeout` seconds (status "ok", "error" or "timeout")."""
    if not calls:
        return []
    num_workers = min(num_processes, len(calls))
    deadline = time.monotonic() + timeout * math.ceil(len(calls) / num_workers) + _DEADLINE_MARGIN_S
    pool = _fork_pool(num_workers, fn)
    try:
        pending = [pool.apply_async(_score_in_worker, (kwargs, timeout, args)) for args, kwargs in calls]
        outcomes = []
        for handle in pending:
            try:
                outcomes.append(handle.get(timeout=max(0.0, deadline - time.monotonic())))
            except multiprocessing.TimeoutError:
                outcomes.append(("timeout", None))
            except Exception as e:  # e.g. a result that cannot be pickled back
                outcomes.append(("error", f"{type(e).__name__}: {e}"))
        return outcomes
    finally:
        pool.terminate()
        pool.join()


def _row_score(status: str, value) -> float:
    """Upstream's reading of one row's result: a number, or the first entry of a tuple; 0.0 on failure."""
    if status != "ok" or value is None:
        return 0.0
    if isinstance(value, (bool, int, float)):
        return float(value)
    return float(value[0])


async def parallel_compute_score_async(
    evaluation_func: Callable,
    completions: list[str],
    references: list,
    tasks: list,
    extra_info: list | None = None,
    num_processes: int = 64,
    timeout: float = 300.0,
) -> list[float]:
    """Score rows in parallel processes: `evaluation_func(task, completion, reference, extra_info)` per row.

    Returns one float per row: the function's number (or the first entry of a returned tuple), 0.0
    when it raised or took longer than `timeout` seconds. The pool runs in a thread, so the event
    loop stays free while it works.
    """
    if extra_info is None:
        extra_info = [None] * len(tasks)
    if not len(completions) == len(references) == len(tasks) == len(extra_info):
        raise ValueError(
            f"parallel_compute_score_async: {len(completions)} completions, {len(references)} references, "
            f"{len(tasks)} tasks and {len(extra_info)} extra_info entries; give one of each per row"
        )
    calls = [((t, c, r, e), {}) for c, r, t, e in zip(completions, references, tasks, extra_info)]
    loop = asyncio.get_running_loop()
    outcomes = await loop.run_in_executor(
        None, _run_in_pool, evaluation_func, calls, int(num_processes), float(timeout)
    )
    return [_row_score(status, value) for status, value in outcomes]


def run_reward_scoring(
    evaluation_func: Callable, completions, references, tasks, extra_info=None, num_processes: int = 64
) -> list[float]:
    """`parallel_compute_score_async` run to completion on a fresh event loop."""
    return asyncio.run(
        parallel_compute_score_async(evaluation_func, completions, references, tasks, extra_info, num_processes)
    )


def _pool_context():
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else None)


@register("prime")
class PrimeRewardManager(AbstractRewardManager):
    """Scores samples in a pool of ``num_processes`` worker processes with a per-sample ``timeout``.

    Args (beyond the base class):
        num_processes: worker processes (default: the CPU count, at most 64).
        timeout: seconds one sample may take (default 300, as upstream).
    """

    ROLLOUT_EXTRA_INFO = ()  # upstream's prime manager passes the row's extra_info as it is

    def __init__(
        self,
        tokenizer,
        num_examine: int,
        compute_score: Callable | None = None,
        reward_fn_key: str = "data_source",
        num_processes: int | None = None,
        timeout: float = 300.0,
        on_error: str = "raise",
    ):
        super().__init__(tokenizer, num_examine, compute_score, reward_fn_key, on_error)
        self.num_processes = int(num_processes or min(64, os.cpu_count() or 1))
        self.timeout = float(timeout)
        if self.num_processes <= 0 or self.timeout <= 0:
            raise ValueError(
                f"num_processes ({self.num_processes}) and timeout ({self.timeout}) must be positive for the prime "
                "reward manager"
            )

    def compute_scores(self, samples: list[Sample]) -> list[ScoreOutcome]:
        calls = [
            (
                (),
                {
                    "data_source": s.data_source,
                    "solution_str": s.solution_str,
                    "ground_truth": s.ground_truth,
                    "extra_info": s.extra_info,
                },
            )
            for s in samples
        ]
        outcomes = []
        for status, value in _run_in_pool(self.compute_score, calls, self.num_processes, self.timeout):
            if status == "ok":
                outcomes.append(ScoreOutcome(result=value))
            elif status == "timeout":
                outcomes.append(ScoreOutcome(timed_out=True))
            else:
                outcomes.append(ScoreOutcome(error=f"{value} (in a prime reward worker)"))
        return outcomes
