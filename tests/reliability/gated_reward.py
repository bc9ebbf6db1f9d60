"""A reward function for the kill-during-save test: the default scorer, except that the first call of
the second training step blocks until the test allows it to go on.

Why: the test must act while the tracker names step 1 and step 2's save has not started. Polling a
free-running 50-step run for that moment loses the race when the test process is starved of CPU
(the run then finishes step 2 between two polls). Blocking step 2's reward pins the run to exactly
that state for as long as the test needs, whatever the machine's load.

Protocol (files in `gate_dir`): the function writes `waiting` when it starts blocking and returns
once `release` exists. Each step scores `samples_per_step` responses, all in the driver's
TaskRunner process, so the call count tells the steps apart. A resumed run (a new process) counts
from zero again, but `release` then exists already, so it never blocks.
"""

from __future__ import annotations

import itertools
import threading
import time
from pathlib import Path

from verl.utils.reward_score import default_compute_score

_calls = itertools.count()
_lock = threading.Lock()  # a reward manager may score samples on several threads


def compute_score(data_source, solution_str, ground_truth, extra_info=None, *, gate_dir: str, samples_per_step: int):
    with _lock:
        n = next(_calls)
    if n == samples_per_step:  # the first response of step 2
        gate = Path(gate_dir)
        (gate / "waiting").touch()
        while not (gate / "release").exists():
            time.sleep(0.05)
    return default_compute_score(data_source, solution_str, ground_truth, extra_info)
