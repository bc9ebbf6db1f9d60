"""A real `python -m verl.trainer.main_ppo --config-name=arith_demo` run on CPU, the worker count left
to verl: the start-up log says the layout it chose and why, and the run trains on that many
workers (the resolved config saved beside the run records it)."""

from __future__ import annotations

import yaml

from tests.trainer.main_ppo_runs import common_overrides, main_ppo_cmd, read_metrics, run_main_ppo
from verl.utils.cpu_layout import choose_cpu_workers
from verl.utils.machine import usable_cores


def test_a_cpu_run_logs_the_layout_it_chose(tmp_path, shared_ray_cluster):
    batch, n = 4, 4
    cmd = main_ppo_cmd(
        "arith_demo",
        *common_overrides(tmp_path, steps=1),
        "trainer.device=cpu",
        f"data.train_batch_size={batch}",
        f"actor_rollout_ref.rollout.n={n}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={batch}",
    )
    proc = run_main_ppo(cmd, tmp_path, cluster=shared_ray_cluster)
    expected = choose_cpu_workers(usable_cores(), batch * n, batch * n)
    lines = [line for line in proc.stderr.splitlines() if "CPU layout chosen automatically" in line]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(f"verl: CPU layout chosen automatically: {expected.workers} worker process(es) "), lines[
        0
    ]
    assert expected.reason in lines[0], lines[0]
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["trainer"]["n_gpus_per_node"] == expected.workers
    assert [r["step"] for r in read_metrics(tmp_path)] == [1]
