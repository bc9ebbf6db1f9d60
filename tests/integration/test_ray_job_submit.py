"""The documented cluster workflow, end to end on this machine: `ray start --head` with the
dashboard on 127.0.0.1 and token authentication, then `ray job submit --runtime-env-json ... --
python -m verl.trainer.main_ppo ...` trains, checkpoints and SUCCEEDS; without the token the job
server refuses the request.

The cluster gets a private temp dir and its own ports (other Ray instances may run here), and is
torn down by killing exactly its processes, never with `ray stop` (which stops every Ray process
of the user). The token lives in a temp file (RAY_AUTH_TOKEN_PATH), so ~/.ray is never touched.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import shutil
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import psutil
import pytest

from tests.integration.ray_cluster_helpers import free_ports, kill_cluster, short_temp_dir

ROOT = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).with_name("ray"))

pytestmark = pytest.mark.slow


def _clean_env() -> dict:
    """This environment minus anything that would point Ray at another cluster or token, or hand
    the cluster this checkout through PYTHONPATH (the jobs must get the code from working_dir)."""
    drop = (
        "RAY_ADDRESS",
        "RAY_AUTH_MODE",
        "RAY_AUTH_TOKEN",
        "RAY_AUTH_TOKEN_PATH",
        "RAY_JOB_CONFIG_JSON_ENV_VAR",
        "PYTHONPATH",
    )
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


@pytest.fixture(scope="module")
def ray_head():
    temp = short_temp_dir("vjob")
    token_path = Path(temp) / "auth_token"
    token_path.write_text(secrets.token_hex(32))
    env = {**_clean_env(), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_path)}
    gcs, dashboard, client, agent_http, agent_grpc, env_agent, metrics, node_manager, object_manager = free_ports(9)
    worker_ports = random.randrange(20000, 30000, 200)  # below the ephemeral range that free_ports draws from
    cmd = [
        RAY, "start", "--head", "--disable-usage-stats", "--num-cpus=2",
        f"--temp-dir={temp}/ray", f"--port={gcs}",
        "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}",
        f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent_http}",
        f"--dashboard-agent-grpc-port={agent_grpc}", f"--runtime-env-agent-port={env_agent}",
        f"--metrics-export-port={metrics}", f"--node-manager-port={node_manager}",
        f"--object-manager-port={object_manager}",
        f"--min-worker-port={worker_ports}", f"--max-worker-port={worker_ports + 199}",
    ]  # fmt: skip
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, f"ray start failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        yield {"address": f"http://127.0.0.1:{dashboard}", "dashboard_port": dashboard, "env": env, "temp": temp}
    finally:
        kill_cluster(temp)
        shutil.rmtree(temp, ignore_errors=True)


def _submit(cmd: list[str], head: dict, timeout: float) -> subprocess.CompletedProcess:
    """Run `ray job submit` from the checkout. Right after `ray start` the head's job agent may not
    have registered yet (Ray answers "No available agent"); that one answer is retried."""
    for _ in range(3):
        proc = subprocess.run(cmd, cwd=ROOT, env=head["env"], capture_output=True, text=True, timeout=timeout)
        if "No available agent" not in proc.stdout + proc.stderr:
            break
        time.sleep(2)
    return proc


def _job_info(head: dict, job_id: str) -> dict:
    """The job server's record of a job (its REST API, with the cluster's token)."""
    token = Path(head["env"]["RAY_AUTH_TOKEN_PATH"]).read_text().strip()
    request = urllib.request.Request(
        f"{head['address']}/api/jobs/{job_id}", headers={"Authorization": f"Bearer {token}"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)


def test_the_dashboard_and_job_server_listen_on_localhost_only(ray_head):
    listening = [
        c.laddr.ip
        for c in psutil.net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == ray_head["dashboard_port"]
    ]
    assert listening == ["127.0.0.1"]


def test_the_job_server_refuses_requests_without_the_token(ray_head, tmp_path):
    env = {**_clean_env(), "HOME": str(tmp_path)}  # no ~/.ray/auth_token either
    list_jobs = [RAY, "job", "list", "--address", ray_head["address"]]
    refused = subprocess.run(list_jobs, env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0
    assert "Unauthorized" in refused.stdout + refused.stderr
    # The token may also come from the environment (RAY_AUTH_TOKEN) instead of a file.
    token = Path(ray_head["env"]["RAY_AUTH_TOKEN_PATH"]).read_text()
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    accepted = subprocess.run(list_jobs, env=env, capture_output=True, text=True, timeout=120)
    assert accepted.returncode == 0, accepted.stdout + accepted.stderr


def test_a_submitted_ppo_job_trains_checkpoints_and_succeeds(ray_head):
    work = Path(ray_head["temp"])
    runtime_env = {
        "working_dir": ".",  # the checkout is shipped to the cluster, as for a remote one
        "excludes": ["/.git"],
        # TOKENIZERS_PARALLELISM is also one of main_ppo's ray.init defaults: Ray refuses to merge a job's
        # runtime_env with a ray.init one that sets the same variable, unless main_ppo leaves it to the job.
        "env_vars": {"VERL_CACHE_DIR": str(work / "cache"), "TOKENIZERS_PARALLELISM": "false"},
    }
    job_id = f"verl-test-{uuid.uuid4().hex[:8]}"
    submit = [
        RAY, "job", "submit", "--address", ray_head["address"], "--submission-id", job_id,
        "--runtime-env-json", json.dumps(runtime_env), "--",
        "python", "-m", "verl.trainer.main_ppo", "--config-name=arith_demo",
        "trainer.total_training_steps=2", "trainer.save_freq=2",
        "trainer.val_before_train=False", "trainer.test_freq=-1", "trainer.n_gpus_per_node=1",
        "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32", "actor_rollout_ref.rollout.n=4",
        f"trainer.default_local_dir={work / 'ckpt'}", f"trainer.run_dir={work / 'run'}",
    ]  # fmt: skip
    # Blocks while tailing the job's logs; the timeout is the job's deadline.
    proc = _submit(submit, ray_head, timeout=420)
    logs = proc.stdout + proc.stderr
    status = _job_info(ray_head, job_id)["status"]
    assert status == "SUCCEEDED", f"job {job_id} is {status}\n--- job ---\n{logs[-6000:]}"
    assert "Connecting to existing Ray cluster" in logs  # the driver joined this cluster, not a new local one
    assert (work / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert (work / "ckpt" / "global_step_2" / "actor").is_dir()
    steps = [json.loads(line)["step"] for line in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 2


def test_upstreams_runtime_env_file_ships_this_checkout_to_the_job(ray_head):
    submit = [
        RAY, "job", "submit", "--address", ray_head["address"],
        "--runtime-env", "verl/trainer/runtime_env.yaml", "--",
        "python", "-c", "import verl; print('verl imported from', verl.__file__)",
    ]  # fmt: skip
    proc = _submit(submit, ray_head, timeout=300)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("verl imported from")), "")
    # the uploaded copy in the cluster's session dir, not this checkout
    assert "working_dir_files" in line and str(ROOT) not in line, proc.stdout[-3000:] + proc.stderr[-3000:]
