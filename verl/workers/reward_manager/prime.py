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
"""

from __future__ import annotations

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


def _score_in_worker(kwargs: dict, timeout: float) -> tuple[str, object]:
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        return "ok", _worker_fn(**kwargs)
    except _SampleTimeout:
        return "timeout", None
    except Exception as e:
        return "error", f"{type(e).__name__}: {e}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


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
        if not samples:
            return []
        num_workers = min(self.num_processes, len(samples))
        rounds = math.ceil(len(samples) / num_workers)
        deadline = time.monotonic() + self.timeout * rounds + _DEADLINE_MARGIN_S
        pool = _fork_pool(num_workers, self.compute_score)
        try:
            pending = [
                pool.apply_async(
                    _score_in_worker,
                    (
                        {
                            "data_source": s.data_source,
                            "solution_str": s.solution_str,
                            "ground_truth": s.ground_truth,
                            "extra_info": s.extra_info,
                        },
                        self.timeout,
                    ),
                )
                for s in samples
            ]
            outcomes = []
            for handle in pending:
                try:
                    status, value = handle.get(timeout=max(0.0, deadline - time.monotonic()))
                except multiprocessing.TimeoutError:
                    outcomes.append(ScoreOutcome(timed_out=True))
                    continue
                except Exception as e:  # e.g. a result that cannot be pickled back
                    outcomes.append(ScoreOutcome(error=f"{type(e).__name__}: {e} (in a prime reward worker)", cause=e))
                    continue
                if status == "ok":
                    outcomes.append(ScoreOutcome(result=value))
                elif status == "timeout":
                    outcomes.append(ScoreOutcome(timed_out=True))
                else:
                    outcomes.append(ScoreOutcome(error=f"{value} (in a prime reward worker)"))
            return outcomes
        finally:
            pool.terminate()
            pool.join()
