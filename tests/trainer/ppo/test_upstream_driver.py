"""Upstream's trainer surface for recipes' own drivers (verl/trainer/ppo/upstream_driver.py): the
module functions against hand-worked values, the phase methods' contracts, and the device and
runtime-env helpers those drivers call before Ray starts."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from verl.protocol import DataProto
from verl.trainer.ppo.ray_trainer import (
    AdvantageEstimator,
    RayPPOTrainer,
    Role,
    apply_kl_penalty,
    compute_advantage,
    compute_response_mask,
)


def _rows() -> DataProto:
    """Two prompts x two samples; responses of 3 tokens, the second and fourth cut short."""
    response_mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 0, 0]])
    prompt = torch.ones(4, 2, dtype=torch.long)
    scores = torch.zeros(4, 3)
    for row, (last, value) in enumerate(zip((2, 1, 2, 0), (1.0, 0.0, 0.5, 0.25), strict=True)):
        scores[row, last] = value
    return DataProto.from_dict(
        tensors={
            "responses": torch.full((4, 3), 7),
            "attention_mask": torch.cat([prompt, response_mask], dim=1),
            "token_level_scores": scores,
            "token_level_rewards": scores.clone(),
            "old_log_probs": torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -0.2, -9.0], [-1.5, -1.0, -1.0], [-3.0, 0, 0]]),
            "ref_log_prob": torch.tensor([[-1.5, -1.0, -0.5], [-0.3, -0.2, -1.0], [-1.0, -1.0, -2.0], [-2.0, 0, 0]]),
        },
        non_tensors={"uid": np.array(["a", "a", "b", "b"], dtype=object)},
    )


def test_compute_response_mask_is_the_attention_mask_s_response_columns():
    batch = _rows()
    expected = [[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 0, 0]]
    assert compute_response_mask(batch).tolist() == expected


def test_apply_kl_penalty_subtracts_beta_times_the_kl_and_feeds_the_controller():
    from verl.trainer.ppo.core_algos import get_kl_controller

    batch = _rows()
    ctrl = get_kl_controller(OmegaConf.create({"type": "adaptive", "kl_coef": 0.1, "target_kl": 0.1, "horizon": 100}))
    out, metrics = apply_kl_penalty(batch, ctrl, kl_penalty="kl")
    # kl estimate "kl": old - ref on valid tokens, by hand
    kld = [[0.5, -1.0, 0.0], [0.2, 0.0, 0.0], [-0.5, 0.0, 1.0], [-1.0, 0.0, 0.0]]
    scores = _rows().batch["token_level_scores"].tolist()
    expected = [[s - 0.1 * k for s, k in zip(srow, krow, strict=True)] for srow, krow in zip(scores, kld, strict=True)]
    torch.testing.assert_close(out.batch["token_level_rewards"], torch.tensor(expected))
    row_means = [(0.5 - 1.0 + 0.0) / 3, 0.2 / 2, 0.5 / 3, -1.0]
    current_kl = sum(row_means) / 4
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(current_kl)
    assert metrics["actor/reward_kl_penalty_coeff"] == pytest.approx(0.1)
    # the adaptive controller saw n_steps = 4 rows: beta *= 1 + clip(kl / 0.1 - 1, -0.2, 0.2) * 4 / 100
    error = max(-0.2, min(0.2, current_kl / 0.1 - 1))
    assert ctrl.value == pytest.approx(0.1 * (1 + error * 4 / 100))


def test_compute_advantage_grpo_normalises_each_uid_group_in_float64():
    batch = _rows()
    out = compute_advantage(batch, AdvantageEstimator.GRPO, num_repeat=2, norm_adv_by_std_in_grpo=True)
    mask = compute_response_mask(_rows()).double()
    # group a: scores 1.0 and 0.0; group b: 0.5 and 0.25; unbiased std, eps 1e-6 (upstream's)
    expected = []
    for a, b in ((1.0, 0.0), (0.5, 0.25)):
        mean, std = (a + b) / 2, math.sqrt(((a - b) ** 2) / 2)
        expected += [(a - mean) / (std + 1e-6), (b - mean) / (std + 1e-6)]
    want = torch.tensor(expected, dtype=torch.float64)[:, None] * mask
    torch.testing.assert_close(out.batch["advantages"].double(), want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out.batch["returns"], out.batch["advantages"])
    assert "response_mask" in out.batch  # added when the caller had none, as upstream


def test_compute_advantage_takes_a_name_and_gae_reads_values_with_gamma_and_lambda():
    batch = _rows()
    batch.batch["values"] = torch.tensor([[0.2, 0.1, 0.0], [0.5, 0.4, 0.3], [0.0, 0.0, 0.0], [0.3, 0.0, 0.0]])
    out = compute_advantage(batch, "gae", gamma=0.9, lam=0.8)
    # row 3 (one valid token): delta = r - V = 0.25 - 0.3; its advantage before whitening
    rewards, values = _rows().batch["token_level_rewards"].double(), batch.batch["values"].double()
    mask = compute_response_mask(_rows()).double()
    raw = torch.zeros(4, 3, dtype=torch.float64)
    for row in range(4):
        last_gae, next_value = 0.0, 0.0
        for t in reversed(range(3)):
            if mask[row, t] == 0:
                continue
            delta = rewards[row, t] + 0.9 * next_value - values[row, t]
            last_gae = delta + 0.9 * 0.8 * last_gae
            raw[row, t], next_value = last_gae, values[row, t]
    torch.testing.assert_close(out.batch["returns"].double(), (raw + values) * mask, atol=1e-6, rtol=1e-6)
    valid = raw[mask.bool()]
    whitened = (raw - valid.mean()) / (valid.var(unbiased=True).sqrt() + 1e-8) * mask
    torch.testing.assert_close(out.batch["advantages"].double(), whitened, atol=1e-5, rtol=1e-5)


def test_get_gen_batch_moves_prompt_columns_and_keeps_the_reward_s():
    ids = torch.arange(8).view(2, 4)
    batch = DataProto.from_dict(
        tensors={"input_ids": ids, "attention_mask": torch.ones(2, 4), "position_ids": ids.clone()},
        non_tensors={
            "raw_prompt_ids": np.array([[1], [2]], dtype=object),
            "data_source": np.array(["x", "y"], dtype=object),
            "reward_model": np.array([{"ground_truth": "1"}, {"ground_truth": "2"}], dtype=object),
            "extra_info": np.array([{}, {}], dtype=object),
        },
    )
    gen = RayPPOTrainer._get_gen_batch(SimpleNamespace(), batch)
    assert set(gen.batch.keys()) == {"input_ids", "attention_mask", "position_ids"}
    assert set(batch.batch.keys()) == set()  # the rollout's output brings them back, prompt + response
    assert set(gen.non_tensor_batch) == {"raw_prompt_ids", "data_source", "reward_model", "extra_info"}
    assert set(batch.non_tensor_batch) == {"data_source", "reward_model", "extra_info"}


def test_balance_batch_writes_its_statistics_under_the_prefix_and_refuses_keep_minibatch():
    lengths = [9, 1, 8, 2, 7, 3, 6, 4]
    mask = torch.tensor([[1] * n + [0] * (10 - n) for n in lengths])
    batch = DataProto.from_dict(tensors={"attention_mask": mask})
    trainer = SimpleNamespace(actor_rollout_wg=SimpleNamespace(world_size=2))
    metrics: dict = {}
    RayPPOTrainer._balance_batch(trainer, batch, metrics, logging_prefix="seqlen")
    halves = batch.batch["attention_mask"].sum(-1).view(2, 4).sum(-1).tolist()
    assert halves == [20, 20], halves  # each rank's tokens: 40 split evenly
    assert metrics["seqlen/balanced_max"] == 20 and not any(k.startswith("global_seqlen") for k in metrics)
    with pytest.raises(NotImplementedError, match="keep_minibatch"):
        RayPPOTrainer._balance_batch(trainer, batch, {}, keep_minibatch=True)


def test_is_cuda_available_reads_as_a_bool_and_as_a_call(monkeypatch):
    from verl.utils import device

    monkeypatch.setenv("VERL_DEVICE", "cpu")
    assert not device.is_cuda_available and device.is_cuda_available() is False
    monkeypatch.setenv("VERL_DEVICE", "auto")
    assert bool(device.is_cuda_available) == torch.cuda.is_available() == device.is_cuda_available()


def test_auto_set_device_exports_the_configured_device_and_refuses_a_missing_gpu(monkeypatch):
    import os

    from verl.utils.device import auto_set_device

    monkeypatch.setenv("VERL_DEVICE", "auto")
    auto_set_device(OmegaConf.create({"trainer": {"device": "cpu"}}))
    assert os.environ["VERL_DEVICE"] == "cpu"
    auto_set_device(OmegaConf.create({"data": {}}))  # no trainer.device: nothing to settle
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="trainer.device=cuda"):
            auto_set_device(OmegaConf.create({"trainer": {"device": "cuda"}}))


def test_ppo_runtime_env_leaves_out_variables_already_set(monkeypatch):
    import json

    from verl.trainer import constants_ppo

    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.delenv(constants_ppo.RAY_JOB_CONFIG_JSON_ENV_VAR, raising=False)
    env = constants_ppo.get_ppo_ray_runtime_env()
    assert "NCCL_DEBUG" not in env["env_vars"] and env["env_vars"]["NCCL_CUMEM_ENABLE"] == "0"
    assert env["working_dir"] is None
    job = {"runtime_env": {"working_dir": "/job"}}
    monkeypatch.setenv(constants_ppo.RAY_JOB_CONFIG_JSON_ENV_VAR, json.dumps(job))
    assert "working_dir" not in constants_ppo.get_ppo_ray_runtime_env()


def _demo_config(tmp_path, *overrides, validate=True):
    from verl.trainer.config import load_ppo_config
    from verl.utils.dataset.arith import ensure_arith_data

    train, test = ensure_arith_data(str(tmp_path))
    return load_ppo_config(
        [f"data.train_files={train}", f"data.val_files={test}", *overrides],
        config_name="arith_demo",
        validate=validate,
    )


def test_a_driver_s_own_trainer_checks_the_config_as_main_ppo_does(tmp_path):
    from verl.trainer.config import ConfigError

    config = _demo_config(tmp_path, "actor_rollout_ref.hybrid_engine=false", validate=False)
    with pytest.raises(ConfigError, match="hybrid_engine"):
        RayPPOTrainer(config=config, tokenizer=None, role_worker_mapping={}, resource_pool_manager=None)


def test_a_mapped_critic_is_used_only_when_the_config_trains_one(tmp_path):
    from verl.trainer.ppo.ray_trainer import Role
    from verl.utils.tokenizer import hf_tokenizer

    config = _demo_config(tmp_path)  # GRPO: no critic
    tokenizer = hf_tokenizer(config.actor_rollout_ref.model.path)
    mapping = {Role.ActorRollout: object, Role.Critic: object}  # recipes' drivers map a critic always
    trainer = RayPPOTrainer(config=config, tokenizer=tokenizer, role_worker_mapping=mapping, resource_pool_manager=None)
    assert not trainer.use_critic
    # datasets not given are built from data.train_files / val_files, as upstream's trainer does
    assert len(trainer.train_dataset) > 0 and len(trainer.val_dataset) > 0
    gae = _demo_config(tmp_path, "algorithm.adv_estimator=gae")
    with pytest.raises(ValueError, match="Role.Critic"):
        RayPPOTrainer(
            config=gae, tokenizer=tokenizer, role_worker_mapping={Role.ActorRollout: object}, resource_pool_manager=None
        )


def test_ray_timeline_is_written_where_the_config_says(ray_session, tmp_path):
    import json

    from verl.trainer.main_ppo import write_ray_timeline

    @ray_session.remote
    def square(x):
        return x * x

    assert ray_session.get([square.remote(i) for i in range(3)]) == [0, 1, 4]
    config = OmegaConf.create({"ray_kwargs": {"timeline_json_file": str(tmp_path / "a.json")}, "ray_init": {}})
    assert write_ray_timeline(config) == str(tmp_path / "a.json")
    events = json.loads((tmp_path / "a.json").read_text())
    assert any("square" in str(event.get("name", "")) for event in events), events[:3]
    # the legacy ray_init.timeline_json_file wins when set; none set writes nothing
    legacy = OmegaConf.create(
        {
            "ray_kwargs": {"timeline_json_file": str(tmp_path / "a.json")},
            "ray_init": {"timeline_json_file": str(tmp_path / "sub" / "b.json")},
        }
    )
    assert write_ray_timeline(legacy) == str(tmp_path / "sub" / "b.json") and (tmp_path / "sub" / "b.json").exists()
    assert write_ray_timeline(OmegaConf.create({"ray_kwargs": {"timeline_json_file": None}})) is None


def test_dump_generations_writes_one_json_line_per_sample(tmp_path):
    import json

    trainer = SimpleNamespace(global_steps=7)
    extra = {"acc": [np.float32(1.0), np.float32(0.0)], "not_per_sample": [1]}
    RayPPOTrainer._dump_generations(trainer, ["q1", "q2"], ["a1", "a2"], ["1", "2"], [1.0, 0.0], extra, str(tmp_path))
    rows = [json.loads(line) for line in (tmp_path / "7.jsonl").read_text().splitlines()]
    assert rows == [
        {"input": "q1", "output": "a1", "gts": "1", "score": 1.0, "step": 7, "acc": 1.0},
        {"input": "q2", "output": "a2", "gts": "2", "score": 0.0, "step": 7, "acc": 0.0},
    ]


def test_upstream_s_ppo_utils_names():
    from verl.trainer.ppo import utils

    assert utils.Role is Role and str(Role.ActorRolloutRef) == "actor_rollout_ref" and str(Role.RefPolicy) == "ref"
    assert Role.from_string("RM") is Role.RewardModel and Role.Env.value == 7
    with pytest.raises(ValueError, match="no Role is named"):
        Role.from_string("judge")
    assert utils.need_reward_model({Role.RewardModel: object}) and not utils.need_reward_model({})
    cfg = OmegaConf.create(
        {
            "critic": {"enable": None},
            "algorithm": {"adv_estimator": "grpo", "use_kl_in_reward": False},
            "actor_rollout_ref": {"actor": {"use_kl_loss": True}},
        }
    )
    assert not utils.need_critic(cfg) and utils.need_reference_policy(cfg)


def test_utils_validate_config_runs_the_trainer_s_check(tmp_path):
    from verl.trainer.config import ConfigError
    from verl.utils.config import validate_config

    validate_config(_demo_config(tmp_path), use_reference_policy=False, use_critic=False)
    with pytest.raises(ConfigError, match="hybrid_engine"):
        validate_config(_demo_config(tmp_path, "actor_rollout_ref.hybrid_engine=false", validate=False), True, True)


def test_a_recipe_trainer_that_skips_our_init_gets_the_driver_state(tmp_path):
    """verl-recipe's SPPO trainer sets upstream's attributes in its own __init__ (reward_fn, hybrid_engine,
    use_* flags, kl_ctrl_in_reward) and calls `_create_dataloader`, never RayPPOTrainer.__init__."""
    from verl.trainer.ppo.rollout_source import RewardScorer
    from verl.utils.tokenizer import hf_tokenizer

    config = _demo_config(tmp_path, "data.train_batch_size=8")

    def reward(data, return_dict=False):
        raise AssertionError("not called here")

    class RecipeTrainer(RayPPOTrainer):
        def __init__(self, config, tokenizer, reward_fn):
            self.tokenizer = tokenizer
            self.processor = None
            self.config = config
            self.reward_fn = reward_fn
            self.val_reward_fn = reward_fn
            self.hybrid_engine = config.actor_rollout_ref.hybrid_engine
            self.role_worker_mapping = {Role.ActorRollout: object}
            self.use_reference_policy = False
            self.use_rm = self.use_critic = False
            self.kl_ctrl_in_reward = "the recipe's"
            self._create_dataloader(None, None, None, None)

    trainer = RecipeTrainer(config, hf_tokenizer(config.actor_rollout_ref.model.path), reward)
    assert isinstance(trainer.reward_scorer, RewardScorer) and trainer.reward_fn is reward
    assert trainer.hybrid_engine is True and trainer.kl_ctrl_in_reward == "the recipe's"
    assert trainer.global_steps == 0 and trainer.rollout_source is None and trainer.reward_model_manager is None
    assert trainer.profiler_config is not None and trainer._step_profiler is not None
    assert trainer.total_training_steps == config.trainer.total_training_steps and len(trainer.train_dataloader) > 0
    trainer._init_driver_state()  # init_workers calls it again: nothing the recipe set is replaced
    assert trainer.kl_ctrl_in_reward == "the recipe's" and trainer.reward_fn is reward
