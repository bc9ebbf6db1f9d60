"""`rollout.prometheus.*` on the driver (verl/trainer/ppo/prometheus.py): the config rule, the scrape
config written at `prometheus.file`, and (slow) a GRPO run in-process whose rollout endpoints,
scraped over HTTP after two steps, count exactly the tokens the run logged."""

from __future__ import annotations

import pytest
import yaml

from tests.trainer.config.test_config_validation import defaults, error_of, with_  # noqa: F401
from verl.trainer.config import validate_ppo_config

ON = {"actor_rollout_ref__rollout__prometheus__enable": True}


def test_enable_with_log_stats_on_validates(defaults):  # noqa: F811
    validate_ppo_config(with_(defaults, **ON, actor_rollout_ref__rollout__disable_log_stats=False))


def test_enable_with_log_stats_disabled_is_refused_as_upstream_refuses_it(defaults):  # noqa: F811
    message = error_of(with_(defaults, **ON, actor_rollout_ref__rollout__disable_log_stats=True))
    assert (
        "actor_rollout_ref.rollout.prometheus.enable=true needs actor_rollout_ref.rollout.disable_log_stats=false"
    ) in message


def test_scrape_config_names_every_endpoint_and_rays_discovery_file(tmp_path):
    from verl.trainer.ppo.prometheus import RAY_SERVICE_DISCOVERY, write_prometheus_config

    path = tmp_path / "new" / "folder" / "prometheus.yml"
    write_prometheus_config(str(path), ["10.0.0.1:40001", "10.0.0.2:40002"])
    written = yaml.safe_load(path.read_text())
    assert written["global"] == {"scrape_interval": "10s", "evaluation_interval": "10s"}
    jobs = {job["job_name"]: job for job in written["scrape_configs"]}
    assert jobs["rollout"]["static_configs"] == [{"targets": ["10.0.0.1:40001", "10.0.0.2:40002"]}]
    assert jobs["ray"]["file_sd_configs"] == [{"files": [RAY_SERVICE_DISCOVERY]}]


def test_publishing_without_endpoints_is_an_error():
    from verl.trainer.ppo.prometheus import publish_rollout_metrics
    from verl.workers.config import PrometheusConfig

    with pytest.raises(RuntimeError, match="no rollout worker serves metrics"):
        publish_rollout_metrics(PrometheusConfig(enable=True), {"actor_rollout_wg": object()})
    assert publish_rollout_metrics(PrometheusConfig(enable=False), {}) == []


@pytest.mark.slow
def test_grpo_run_serves_the_tokens_it_generated(ray_session, tmp_path, monkeypatch):
    pytest.importorskip("prometheus_client")
    from tests.trainer.test_algorithm_steps import GRPO, ROWS, _fit, script_config
    from tests.workers.rollout.test_metrics_server import scrape
    from verl.single_controller.ray import RayWorkerGroup, ResourcePoolManager
    from verl.trainer.main_ppo import build_role_worker_mapping
    from verl.trainer.ppo.worker_groups import spawn_worker_groups
    from verl.utils.dataset.arith import ensure_arith_data

    data = ensure_arith_data(str(tmp_path / "arith"))
    config = script_config(GRPO, tmp_path, data, steps=2)
    scrape_file = tmp_path / "prometheus" / "prometheus.yml"
    for key, value in (("enable", True), ("file", str(scrape_file))):
        config.actor_rollout_ref.rollout.prometheus[key] = value
    config.actor_rollout_ref.rollout.disable_log_stats = False
    validate_ppo_config(config)
    mapping = build_role_worker_mapping(config)
    pools = ResourcePoolManager(resource_pool_spec={"global_pool": [2]}, mapping=dict.fromkeys(mapping, "global_pool"))
    groups = spawn_worker_groups(config, mapping, pools, RayWorkerGroup)
    try:
        steps = _fit(config, groups, tmp_path, monkeypatch)
        targets = yaml.safe_load(scrape_file.read_text())["scrape_configs"][1]["static_configs"][0]["targets"]
        assert len(targets) == 2  # one engine a rank
        served = [scrape(target) for target in targets]
    finally:
        for pool in pools.resource_pool_dict.values():
            pool.remove_placement_groups()
    records = [r["data"] for r in steps if "response_length/mean" in r["data"]]
    assert len(records) == 2
    generated = sum(round(r["response_length/mean"] * ROWS) for r in records)
    prompt_tokens = sum(round(r["prompt_length/mean"] * ROWS) for r in records)
    assert sum(s["verl_rollout_requests_total"] for s in served) == 2 * ROWS
    assert sum(s["verl_rollout_generation_tokens_total"] for s in served) == generated > 0
    assert sum(s["verl_rollout_prompt_tokens_total"] for s in served) == prompt_tokens
    assert [s["verl_rollout_generate_seconds_count"] for s in served] == [2, 2]
