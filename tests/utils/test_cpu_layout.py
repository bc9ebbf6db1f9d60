"""The automatic CPU worker layout (verl.utils.cpu_layout): the rule on hand-worked machines, an
explicit setting never overridden, and the demo config resolving through it."""

from __future__ import annotations

import pytest

from verl.utils import cpu_layout
from verl.utils.cpu_layout import (
    MAX_AUTO_WORKERS,
    choose_cpu_workers,
    cpu_worker_thread_env,
    resolve_cpu_workers,
    threads_per_worker,
)
from verl.utils.machine import usable_cores


@pytest.mark.parametrize(
    "cores, rows, mini, workers, threads",
    [
        (1, 256, 256, 1, 1),  # a laptop core: one process
        (2, 256, 256, 2, 1),  # this Xeon VM: 2 x 1 (measured faster than 1 x 2)
        (4, 256, 256, 4, 1),
        (6, 256, 256, 4, 1),  # 6 and 5 do not divide 256; the 2 spare cores stay unused as threads: 6 // 4 = 1
        (16, 256, 256, 8, 2),  # capped at 8 processes, the other cores as threads
        (64, 256, 256, 8, 8),
        (3, 24, 8, 2, 1),  # 3 divides the 24-row batch but not the 8-row mini-batch
        (4, 7, 7, 1, 4),  # a prime batch: one process, all cores as threads
    ],
)
def test_choice_on_hand_worked_machines(cores, rows, mini, workers, threads):
    layout = choose_cpu_workers(cores, rows, mini)
    assert (layout.workers, layout.threads) == (workers, threads), layout


def test_the_reason_says_what_limited_the_choice():
    assert "8 processes" in choose_cpu_workers(16, 256).reason
    assert "divides the 24-row batch and 8-row mini-batch" in choose_cpu_workers(3, 24, 8).reason
    assert choose_cpu_workers(2, 256).reason == "2 usable core(s), one process per core"
    assert MAX_AUTO_WORKERS == 8


def test_bad_inputs_say_what_is_wrong():
    with pytest.raises(ValueError, match="cores >= 1"):
        choose_cpu_workers(0, 256)
    with pytest.raises(ValueError, match=r"not one of \['auto', 'cpu', 'cuda'\]"):
        resolve_cpu_workers("tpu", 2, 32, 8)


def test_threads_split_the_cores_among_the_node_workers():
    assert [threads_per_worker(8, w) for w in (1, 2, 3, 8, 16)] == [8, 4, 2, 1, 1]


def test_thread_env_for_cpu_workers_and_never_over_a_user_setting():
    expected = str(max(1, usable_cores() // 1))
    assert cpu_worker_thread_env(False, 1, {}, {}) == {"OMP_NUM_THREADS": expected}
    assert cpu_worker_thread_env(True, 1, {}) == {}  # GPU workers: untouched
    # the user's OMP_NUM_THREADS in the driver's env, worker_env or the class's runtime_env wins
    for envs in (
        ({"OMP_NUM_THREADS": "3"}, {}, {}),
        ({}, {"OMP_NUM_THREADS": "3"}, {}),
        ({}, {}, {"OMP_NUM_THREADS": "3"}),
    ):
        assert cpu_worker_thread_env(False, 1, *envs) == {}


def test_a_bad_batch_value_is_left_to_the_config_check(capsys):
    # the check names data.train_batch_size; the interpolation must not fail first under its own name
    assert resolve_cpu_workers("cpu", 2, "abc", 8) >= 1
    assert resolve_cpu_workers("cpu", 2, 0, 8) >= 1
    assert capsys.readouterr().err == ""


def test_gpu_keeps_the_written_worker_count(capsys):
    assert resolve_cpu_workers("cuda", 2, 32, 8, 32) == 2
    assert capsys.readouterr().err == ""


def test_cpu_resolves_from_this_machine_and_logs_one_line(monkeypatch, capsys):
    monkeypatch.setattr(cpu_layout, "usable_cores", lambda: 16)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert resolve_cpu_workers("cpu", 2, 32, 8, 32) == 8
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "verl: CPU layout chosen automatically: 8 worker process(es) x 2 thread(s) each: 16 usable core(s), one "
        "process per core; at most 8 processes, the other cores as threads (set trainer.n_gpus_per_node and/or "
        "OMP_NUM_THREADS to choose another)"
    ]
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert resolve_cpu_workers("cpu", 2, 32, 8, 32) == 8
    assert "each with OMP_NUM_THREADS=1 thread(s) as set" in capsys.readouterr().err


def test_the_demo_config_chooses_on_cpu_and_an_explicit_value_wins(capsys):
    from verl.trainer.config import load_ppo_config

    auto = load_ppo_config(["trainer.device=cpu"], config_name="arith_demo")
    rows = auto.data.train_batch_size * auto.actor_rollout_ref.rollout.n
    assert auto.trainer.n_gpus_per_node == choose_cpu_workers(usable_cores(), rows).workers
    assert capsys.readouterr().err.count("CPU layout chosen automatically") == 1  # once per load
    # an explicit count is used as given, even where the rule would choose another, and nothing is logged
    other = 1 if auto.trainer.n_gpus_per_node != 1 else 4
    given = load_ppo_config(["trainer.device=cpu", f"trainer.n_gpus_per_node={other}"], config_name="arith_demo")
    assert given.trainer.n_gpus_per_node == other
    assert "CPU layout" not in capsys.readouterr().err
