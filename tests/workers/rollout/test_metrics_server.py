"""`rollout.prometheus.enable`: each rollout engine serves what it generated over HTTP in the
Prometheus text format (verl/workers/rollout/metrics_server.py), scraped here over a real socket
and parsed with prometheus_client's own parser."""

from __future__ import annotations

import urllib.request

import pytest
import torch

from verl.protocol import DataProto

prom_parser = pytest.importorskip("prometheus_client.parser", reason="needs prometheus_client")


def scrape(address: str) -> dict[str, float]:
    """`/metrics` of `address` (host:port): sample name -> value, summed over label sets."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        assert response.status == 200
        text = response.read().decode()
    values: dict[str, float] = {}
    for family in prom_parser.text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def labels_of(address: str, name: str) -> dict[str, str]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        text = response.read().decode()
    for family in prom_parser.text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return dict(sample.labels)
    raise AssertionError(f"{name} not served")


def generated(prompt_lengths: list[int], response_lengths: list[int], prompt_width=6, response_width=5) -> DataProto:
    """A generate_sequences result: left-padded prompts, right-padded responses."""
    rows = len(prompt_lengths)
    prompt_mask = torch.zeros(rows, prompt_width, dtype=torch.long)
    response_mask = torch.zeros(rows, response_width, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompt_lengths, response_lengths, strict=True)):
        prompt_mask[i, prompt_width - p :] = 1
        response_mask[i, :r] = 1
    return DataProto.from_dict(
        {
            "prompts": torch.ones(rows, prompt_width, dtype=torch.long),
            "responses": torch.ones(rows, response_width, dtype=torch.long),
            "attention_mask": torch.cat([prompt_mask, response_mask], dim=1),
            "response_mask": response_mask,
        }
    )


@pytest.fixture
def server():
    from verl.workers.rollout.metrics_server import RolloutMetricsServer

    s = RolloutMetricsServer("MiMo-7B-RL", "hf", host="127.0.0.1")
    yield s
    s.close()


def test_endpoint_counts_requests_prompt_and_generated_tokens(server):
    address = f"127.0.0.1:{server.port}"
    assert scrape(address)["verl_rollout_generation_tokens_total"] == 0
    server.observe(generated([6, 3, 1], [5, 2, 0]), seconds=0.3)
    server.observe(generated([2], [4]), seconds=2.0)
    values = scrape(address)
    assert values["verl_rollout_requests_total"] == 4
    assert values["verl_rollout_prompt_tokens_total"] == 6 + 3 + 1 + 2
    assert values["verl_rollout_generation_tokens_total"] == 5 + 2 + 0 + 4
    assert values["verl_rollout_generate_seconds_count"] == 2
    assert values["verl_rollout_generate_seconds_sum"] == pytest.approx(2.3)
    assert labels_of(address, "verl_rollout_requests_total") == {"model_name": "MiMo-7B-RL", "engine": "hf"}


def test_two_servers_in_one_process_count_apart(server):
    from verl.workers.rollout.metrics_server import RolloutMetricsServer

    other = RolloutMetricsServer("m", "vllm", host="127.0.0.1")
    try:
        assert other.port != server.port
        other.observe(generated([1], [3]), seconds=0.1)
        assert scrape(f"127.0.0.1:{other.port}")["verl_rollout_generation_tokens_total"] == 3
        assert scrape(f"127.0.0.1:{server.port}")["verl_rollout_generation_tokens_total"] == 0
    finally:
        other.close()


def test_empty_result_of_a_rank_without_engine_counts_nothing(server):
    server.observe(DataProto(), seconds=1.0)
    values = scrape(f"127.0.0.1:{server.port}")
    assert values["verl_rollout_requests_total"] == 0
    assert values["verl_rollout_generate_seconds_count"] == 0


@pytest.mark.parametrize(
    ("name", "path", "expected"),
    [
        (None, "/models/MiMo-7B-RL", "MiMo-7B-RL"),
        ("/home/user/verl/models/MiMo-7B-RL/", "/x", "MiMo-7B-RL"),
        ("my-model", "/x", "my-model"),
    ],
)
def test_served_model_name_is_the_last_path_component(name, path, expected):
    from verl.workers.rollout.metrics_server import served_model_name

    assert served_model_name(name, path) == expected


def test_rollout_worker_serves_the_tokens_it_generated(one_process):
    """The built-in engine in a rollout worker: what its endpoint counts is what it returned."""
    from verl.models import bundled_model_path
    from verl.trainer.config import load_ppo_config
    from verl.utils.tokenizer import hf_tokenizer
    from verl.workers.fsdp_workers import ActorRolloutRefWorker

    cfg = load_ppo_config(
        [
            f"actor_rollout_ref.model.path={bundled_model_path()}",
            "actor_rollout_ref.rollout.prometheus.enable=true",
            "actor_rollout_ref.rollout.disable_log_stats=false",
            "actor_rollout_ref.rollout.response_length=6",
            "trainer.n_gpus_per_node=1",
        ],
        config_name="arith_demo",
    )
    worker = ActorRolloutRefWorker(cfg.actor_rollout_ref, role="rollout")
    worker.init_model()
    try:
        tokenizer = hf_tokenizer(bundled_model_path())
        tokenizer.padding_side = "left"
        enc = tokenizer(["1+2=", "12+30=", "7+7="], return_tensors="pt", padding=True)
        mask = enc["attention_mask"]
        prompts = DataProto.from_dict(
            {
                "input_ids": enc["input_ids"],
                "attention_mask": mask,
                "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
            },
            meta_info={"do_sample": True},
        )
        out = worker.generate_sequences(prompts)
        address = worker.rollout_metrics_address()
        port = address.rsplit(":", 1)[1]
        values = scrape(f"127.0.0.1:{port}")
        n = cfg.actor_rollout_ref.rollout.n  # the engine samples n responses a prompt
        assert len(out) == 3 * n
        assert values["verl_rollout_requests_total"] == 3 * n
        assert values["verl_rollout_prompt_tokens_total"] == n * int(mask.sum())
        assert values["verl_rollout_generation_tokens_total"] == int(out.batch["response_mask"].sum()) > 0
        assert values["verl_rollout_generate_seconds_count"] == 1
    finally:
        worker.rollout_metrics.close()
