"""The side-by-side GRPO benchmarks configure both sides alike (no training runs here).

`benchmarks/grpo_common.py` maps one set of hyper-parameters onto our Hydra overrides and onto
TRL's `GRPOConfig`; these tests check the mapping against the real config loaders: ours
(`load_ppo_config`) and TRL's own batch arithmetic in `GRPOConfig.__post_init__`.
"""

from __future__ import annotations

import pytest

from benchmarks.grpo_common import ArithReward, GRPOSetup, ours_overrides, trl_batch_args, yaml_defaults


@pytest.mark.parametrize(
    ("batch", "n", "mini", "micro", "expected"),
    [
        # 32 prompts x 8 = 256 completions, one optimizer step over all of them in one forward
        (32, 8, 32, None, {"per_device_train_batch_size": 256, "gradient_accumulation_steps": 1}),
        # the same step in 4 micro-batches of 64 accumulated
        (32, 8, 32, 64, {"per_device_train_batch_size": 64, "gradient_accumulation_steps": 4}),
        # 4 optimizer steps (8 prompts x 8 each) per generated batch
        (32, 8, 8, None, {"per_device_train_batch_size": 64, "gradient_accumulation_steps": 1}),
    ],
)
def test_trl_batch_args_consume_one_generated_batch_in_batch_over_mini_optimizer_steps(batch, n, mini, micro, expected):
    args = trl_batch_args(batch, n, mini, micro)
    assert {k: args[k] for k in expected} == expected
    assert args["num_generations"] == n
    # completions generated at once, and optimizer steps that consume them
    assert args["per_device_train_batch_size"] * args["steps_per_generation"] == batch * n
    assert args["steps_per_generation"] / args["gradient_accumulation_steps"] == batch // mini


def test_trl_batch_args_reject_a_mini_batch_or_micro_batch_that_does_not_divide():
    with pytest.raises(ValueError, match="not a multiple of mini_batch_size=12"):
        trl_batch_args(32, 8, 12)
    with pytest.raises(ValueError, match="micro_batch_size=100 does not divide the 256 completions"):
        trl_batch_args(32, 8, 32, 100)


@pytest.mark.filterwarnings("ignore:.*gradient_checkpointing.*:FutureWarning")  # transformers 5 renamed it
@pytest.mark.parametrize(("mini", "micro"), [(32, None), (32, 64), (8, 32)])
def test_trls_own_config_derives_the_same_generation_batch_and_optimizer_steps(mini, micro):
    trl = pytest.importorskip("trl")
    config = trl.GRPOConfig(
        output_dir="unused", use_cpu=True, report_to="none", num_iterations=1, **trl_batch_args(32, 8, mini, micro)
    )
    assert config.generation_batch_size == 256  # TRL's derivation (one process): 32 prompts x 8
    assert config.steps_per_generation // config.gradient_accumulation_steps == 32 // mini


def test_yaml_defaults_match_the_loaded_ppo_config():
    from verl.trainer.config import load_ppo_config

    cfg = load_ppo_config([], config_name="arith_demo")
    actor = cfg.actor_rollout_ref.actor
    defaults = yaml_defaults()
    assert defaults["batch_size"] == cfg.data.train_batch_size
    assert defaults["mini_batch_size"] == actor.ppo_mini_batch_size
    assert defaults["n"] == cfg.actor_rollout_ref.rollout.n
    assert defaults["lr"] == pytest.approx(actor.optim.lr)
    assert defaults["weight_decay"] == pytest.approx(actor.optim.weight_decay)
    assert defaults["max_response_length"] == cfg.data.max_response_length
    assert defaults["workers"] == cfg.trainer.n_gpus_per_node


def test_ours_overrides_are_accepted_by_main_ppos_loader_and_pin_every_value(tmp_path):
    from verl.trainer.config import load_ppo_config

    setup = GRPOSetup(batch_size=16, n=4, mini_batch_size=8, lr=3e-4, weight_decay=0.0, kl_coef=0.01, epochs=2)
    cfg = load_ppo_config(ours_overrides(setup, str(tmp_path), total_steps=7, test_freq=5), config_name="arith_demo")
    actor = cfg.actor_rollout_ref.actor
    assert (cfg.data.train_batch_size, actor.ppo_mini_batch_size, cfg.actor_rollout_ref.rollout.n) == (16, 8, 4)
    assert (actor.optim.lr, actor.optim.weight_decay, actor.ppo_epochs) == (3e-4, 0.0, 2)
    assert actor.use_kl_loss is True and actor.kl_loss_coef == 0.01
    assert (cfg.trainer.total_training_steps, cfg.trainer.test_freq) == (7, 5)
    assert actor.ppo_micro_batch_size_per_gpu == 16  # 8 prompts x 4 / 2 ranks: one micro-batch per rank
    assert cfg.trainer.run_dir == str(tmp_path / "run")


def test_arith_reward_scores_the_first_integer_and_counts_completion_tokens():
    reward = ArithReward()
    scores = reward(
        prompts=[[{"role": "user", "content": "What is 37+48?"}]] * 3,
        completions=[[{"role": "assistant", "content": c}] for c in ("85", "84", "37+48 is 85")],
        completion_ids=[[10, 11, 3], [10, 12, 3], [5, 6, 7, 10, 11]],
        data_source=["arith"] * 3,
        reward_model=[{"style": "rule", "ground_truth": "85"}] * 3,
        extra_info=[{}] * 3,
    )
    assert scores == [1.0, 0.0, 0.0]  # the answer must come first
    assert reward.tokens_per_call == [11]


@pytest.mark.parametrize(
    ("layout", "tp", "pp", "vpp", "cp"),
    [
        ("fsdp", None, None, None, None),
        ("tp2", 2, 1, None, 1),
        ("pp2", 1, 2, None, 1),
        ("pp2v2", 1, 2, 2, 1),
        ("cp2", 1, 1, None, 2),
    ],
)
def test_megatron_vs_fsdp_layouts_configure_the_backend_and_parallel_sizes_they_name(layout, tp, pp, vpp, cp):
    import argparse

    from benchmarks.megatron_vs_fsdp import _overrides, config_name
    from verl.models import bundled_model_path
    from verl.trainer.config import load_ppo_config

    args = argparse.Namespace(ranks=2, batch=8, seq_len=32, micro_batch=2, dtype="fp32", gradient_checkpointing=False)
    cfg = load_ppo_config(_overrides(args, layout, bundled_model_path()), config_name=config_name(layout))
    actor = cfg.actor_rollout_ref.actor
    assert actor.ppo_mini_batch_size == 8 and actor.ppo_micro_batch_size_per_gpu == 2
    assert cfg.data.max_prompt_length + cfg.data.max_response_length == 32
    if tp is None:
        assert actor.strategy == "fsdp"
    else:
        assert actor.strategy == "megatron"
        assert actor.megatron.tensor_model_parallel_size == tp
        assert actor.megatron.pipeline_model_parallel_size == pp
        assert actor.megatron.virtual_pipeline_model_parallel_size == vpp
        assert actor.megatron.context_parallel_size == cp
