"""Upstream keys whose behaviour existed here under another spelling change what they should.

Each test sets the upstream key and checks the effect against a hand-computed value: the clipped
gradient norm, the compute dtype, the learning-rate schedule, the reward manager built, the weight
sync bucket size, deterministic kernels. (The default agent loop: tests/experimental/agent_loop;
trainer.tensorboard_dir: tests/utils/test_tracking.py; rollout.mode=async and the rest of
upstream's defaults: tests/trainer/test_upstream_quickstart.py.)
"""

from __future__ import annotations

import math

import pytest
import torch

from verl.trainer.config import ConfigError, load_ppo_config
from verl.utils.optim import grad_clip
from verl.workers.dp_training import clip_grad_norm


def _clipped_norm(role_config: dict) -> float:
    """The gradient norm after clipping a gradient of norm 10 with the role's settings."""
    module = torch.nn.Linear(4, 1, bias=False)
    module.weight.grad = torch.full_like(module.weight, 5.0)  # norm sqrt(4 x 25) = 10
    before = clip_grad_norm(module, grad_clip(role_config))
    assert float(before) == pytest.approx(10.0)
    return float(module.weight.grad.norm())


def test_optim_clip_grad_sets_the_clip_of_fsdp_and_megatron_roles():
    assert _clipped_norm({"grad_clip": 1.0, "optim": {"clip_grad": 1.0}}) == pytest.approx(1.0)
    assert _clipped_norm({"grad_clip": 1.0, "optim": {"clip_grad": 0.5}}) == pytest.approx(0.5)  # upstream's newer key
    assert _clipped_norm({"grad_clip": 2.0, "optim": {"clip_grad": 1.0}}) == pytest.approx(2.0)  # the FSDP role's own
    assert _clipped_norm({"optim": {"clip_grad": 0.25}}) == pytest.approx(0.25)  # a Megatron role has no grad_clip


def test_two_different_clips_are_refused():
    with pytest.raises(ConfigError, match="both set the gradient-norm clip"):
        load_ppo_config(
            ["actor_rollout_ref.actor.grad_clip=2.0", "actor_rollout_ref.actor.optim.clip_grad=0.5"],
            config_name="arith_demo",
        )


def test_fsdp_config_dtype_is_the_compute_dtype_without_a_mixed_precision_section():
    from verl.utils.fsdp_utils import get_mixed_precision_policy

    assert get_mixed_precision_policy(None, "bfloat16").param_dtype == torch.bfloat16  # upstream's default
    assert get_mixed_precision_policy(None, "float16").param_dtype == torch.float16
    assert get_mixed_precision_policy(None, "float32").reduce_dtype == torch.float32
    section = get_mixed_precision_policy({"param_dtype": "fp32"}, "bfloat16")  # the section wins
    assert section.param_dtype == torch.float32
    if not torch.cuda.is_available():
        assert get_mixed_precision_policy(None, "auto").param_dtype is None  # ours: the weights' dtype on CPU


def _lrs(optim: dict, steps: int) -> list[float]:
    from verl.utils.optim import build_lr_scheduler

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=optim["lr"])
    scheduler = build_lr_scheduler(optimizer, optim)
    out = []
    for _ in range(steps):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return out


def test_warmup_style_wins_over_lr_scheduler_type_as_upstream():
    """Upstream's default is lr_scheduler_type=constant, warmup_style=null; setting the older key alone
    must switch the schedule (it used to be shadowed by the newer key's default)."""
    optim = {"lr": 1.0, "total_training_steps": 10, "lr_scheduler_type": "constant", "warmup_style": "cosine"}
    lrs = _lrs(optim, 10)
    expected = [0.5 * (1 + math.cos(math.pi * t / 10)) for t in range(10)]  # half a cosine from 1 to 0
    assert lrs == pytest.approx(expected)
    assert _lrs({**optim, "warmup_style": None}, 3) == [1.0, 1.0, 1.0]


def test_megatron_lr_decay_style_and_min_lr_are_the_cosine_schedule():
    from verl.workers.megatron_workers import megatron_optim_settings

    optim = {"lr": 2.0, "total_training_steps": 10, "lr_decay_style": "cosine", "min_lr": 0.5, "lr_warmup_steps": -1}
    settings = megatron_optim_settings(optim)
    assert settings["lr_scheduler_type"] == "cosine" and settings["min_lr_ratio"] == 0.25
    lrs = _lrs(settings, 10)
    # lr(t) = min_lr + (lr - min_lr) * (1 + cos(pi t / T)) / 2
    assert lrs == pytest.approx([0.5 + 1.5 * 0.5 * (1 + math.cos(math.pi * t / 10)) for t in range(10)])


def test_reward_manager_name_and_a_class_from_a_file(tmp_path):
    from verl.trainer.ppo.reward import load_reward_manager
    from verl.utils.tokenizer import hf_tokenizer
    from verl.workers.reward_manager import BatchRewardManager, NaiveRewardManager

    demo = load_ppo_config(config_name="arith_demo")
    tokenizer = hf_tokenizer(demo.actor_rollout_ref.model.path)
    assert type(load_reward_manager(demo, tokenizer, 0)) is NaiveRewardManager  # follows reward_model.reward_manager
    batch = load_ppo_config(["reward_manager.name=batch"], config_name="arith_demo")
    assert type(load_reward_manager(batch, tokenizer, 0)) is BatchRewardManager
    (tmp_path / "my_manager.py").write_text(
        "from verl.workers.reward_manager import NaiveRewardManager\n\n\n"
        "class ShoutingRewardManager(NaiveRewardManager):\n    pass\n"
    )
    custom = load_ppo_config(
        [
            "reward_manager.source=importlib",
            f"reward_manager.module.path={tmp_path / 'my_manager.py'}",
            "reward_manager.module.name=ShoutingRewardManager",
        ],
        config_name="arith_demo",
    )
    assert type(load_reward_manager(custom, tokenizer, 0)).__name__ == "ShoutingRewardManager"
    with pytest.raises(ConfigError, match="reward_manager.source=importlib needs reward_manager.module.path"):
        load_ppo_config(["reward_manager.source=importlib"], config_name="arith_demo")


def test_checkpoint_engine_bucket_size_reaches_the_engine_config():
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import RolloutConfig

    cfg = load_ppo_config(
        ["actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=64"], config_name="arith_demo"
    )
    config = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout, RolloutConfig)
    assert config.checkpoint_engine.update_weights_bucket_megabytes == 64  # what the SGLang adapter buckets by


def test_full_determinism_turns_on_deterministic_kernels_and_seeds():
    from verl.utils.device import enable_full_determinism

    try:
        enable_full_determinism(7)
        assert torch.are_deterministic_algorithms_enabled()
        first = torch.rand(3)
        enable_full_determinism(7)
        assert torch.equal(first, torch.rand(3))  # seeded with fsdp_config.seed
    finally:
        torch.use_deterministic_algorithms(False)


def test_rollout_correction_is_checked_before_the_run_starts():
    base = ["algorithm.rollout_correction.rollout_is=token"]
    with pytest.raises(ConfigError, match="calculate_log_probs=true"):  # on by default (upstream v0.9.0)
        load_ppo_config([*base, "actor_rollout_ref.rollout.calculate_log_probs=false"], config_name="arith_demo")
    cfg = load_ppo_config([*base, "actor_rollout_ref.rollout.calculate_log_probs=true"], config_name="arith_demo")
    assert cfg.algorithm.rollout_correction.rollout_is == "token"
    with pytest.raises(ConfigError, match="rollout_is='word' must be null or one of"):
        load_ppo_config(
            ["algorithm.rollout_correction.rollout_is=word", "actor_rollout_ref.rollout.calculate_log_probs=true"],
            config_name="arith_demo",
        )


def test_optimal_token_baseline_needs_the_sum_of_squared_probabilities():
    with pytest.raises(ConfigError, match="calculate_sum_pi_squared=true"):
        load_ppo_config(["algorithm.adv_estimator=optimal_token_baseline"], config_name="arith_demo")
    cfg = load_ppo_config(
        ["algorithm.adv_estimator=optimal_token_baseline", "actor_rollout_ref.actor.calculate_sum_pi_squared=true"],
        config_name="arith_demo",
    )
    assert cfg.algorithm.adv_estimator == "optimal_token_baseline"


def test_optimizer_keys_reach_the_optimizer():
    from verl.utils.optim import build_optimizer

    cfg = load_ppo_config(
        [
            "actor_rollout_ref.actor.optim.optimizer=SGD",
            "actor_rollout_ref.actor.optim.weight_decay=0.0",
            "+actor_rollout_ref.actor.optim.override_optimizer_config={momentum: 0.5}",
        ],
        config_name="arith_demo",
    )
    opt = build_optimizer([torch.nn.Parameter(torch.zeros(2))], cfg.actor_rollout_ref.actor.optim)
    assert type(opt) is torch.optim.SGD and opt.defaults["momentum"] == 0.5


def test_pf_ppo_is_accepted_and_warns_where_it_has_no_effect():
    from verl.trainer.config import ConfigWarning

    cfg = load_ppo_config(
        ["algorithm.use_pf_ppo=true", "algorithm.adv_estimator=gae", "critic.enable=true"], config_name="arith_demo"
    )
    assert cfg.algorithm.use_pf_ppo is True
    with pytest.warns(ConfigWarning, match="use_pf_ppo=true has no effect with algorithm.adv_estimator=grpo"):
        load_ppo_config(["algorithm.use_pf_ppo=true"], config_name="arith_demo")


def test_custom_chat_template_replaces_the_template_the_policy_workers_render_with():
    from verl.utils.tokenizer import hf_tokenizer

    content_only = "{% for message in messages %}{{ message['content'] }}{% endfor %}"  # upstream's geo3k set's
    cfg = load_ppo_config(
        ["actor_rollout_ref.model.custom_chat_template=" + repr(content_only)], config_name="arith_demo"
    )
    path = cfg.actor_rollout_ref.model.path
    messages = [{"role": "system", "content": "Be brief. "}, {"role": "user", "content": "1+1="}]

    # what ActorRolloutRefWorker.init_model loads
    worker_tok = hf_tokenizer(path, chat_template=cfg.actor_rollout_ref.model.custom_chat_template)
    assert worker_tok.apply_chat_template(messages, tokenize=False) == "Be brief. 1+1="
    own = hf_tokenizer(path).apply_chat_template(messages, tokenize=False)
    assert own != "Be brief. 1+1=" and "1+1=" in own  # the tokenizer's own template adds role markers
