"""Worker config sections (`verl.workers.config`: optimizer, FSDP engine, actor, critic, rollout, model):
the YAML's `_target_` picks the engine's class, its defaults are the YAML's, its own checks run when
built, and the validator and the docs list the keys only one subclass holds."""

from __future__ import annotations

import copy
import dataclasses

import pytest
from omegaconf import OmegaConf

from verl.trainer.config import ConfigError, validate_ppo_config
from verl.trainer.config.docgen import render
from verl.trainer.config.loader import compose
from verl.trainer.config.schema import section_fields
from verl.trainer.config.validate import schema_keys
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config import (
    ActorConfig,
    CriticConfig,
    FSDPActorConfig,
    FSDPCriticConfig,
    FSDPEngineConfig,
    FSDPOptimizerConfig,
    HFModelConfig,
    McoreActorConfig,
    McoreCriticConfig,
    McoreOptimizerConfig,
    MultiTurnConfig,
    OptimizerConfig,
    RolloutConfig,
    SamplingConfig,
)


def _without_target(config) -> dict:
    return {k: v for k, v in dataclasses.asdict(config).items() if k != "_target_"}


@pytest.mark.parametrize(
    "name, cls",
    [("ppo_trainer", FSDPOptimizerConfig), ("ppo_megatron_trainer", McoreOptimizerConfig)],
)
def test_each_trainer_builds_its_engines_optimizer_class_with_the_yaml_defaults(name, cls):
    cfg = compose(name)
    for section in (cfg.actor_rollout_ref.actor.optim, cfg.critic.optim):
        built = omega_conf_to_dataclass(section)
        assert type(built) is cls
        # the YAML sets the roles' own learning rates (and optim/fsdp.yaml min_lr_ratio 0.0 where upstream's
        # dataclass default is null; both read as 0); everything else is the class default
        yaml_only = {"min_lr_ratio": built.min_lr_ratio} if cls is FSDPOptimizerConfig else {}
        assert yaml_only in ({}, {"min_lr_ratio": 0.0})
        assert _without_target(built) == _without_target(cls(lr=built.lr, **yaml_only))
    assert omega_conf_to_dataclass(cfg.actor_rollout_ref.actor.optim).lr == pytest.approx(1e-6)
    assert omega_conf_to_dataclass(cfg.critic.optim).lr == pytest.approx(1e-5)


def test_optimizer_defaults_are_upstreams():
    # upstream's optim/fsdp.yaml and optim/megatron.yaml, written out by hand
    fsdp = FSDPOptimizerConfig()
    assert (fsdp.lr, fsdp.weight_decay, fsdp.betas, fsdp.clip_grad) == (1e-3, 0.01, [0.9, 0.999], 1.0)
    assert (fsdp.lr_warmup_steps, fsdp.lr_warmup_steps_ratio, fsdp.total_training_steps) == (-1, 0.0, -1)
    assert (fsdp.optimizer, fsdp.optimizer_impl, fsdp.lr_scheduler_type) == ("AdamW", "torch.optim", "constant")
    # min_lr_ratio: upstream's dataclass default (null, read as 0); its YAML writes 0.0
    assert (fsdp.min_lr_ratio, fsdp.num_cycles, fsdp.warmup_style, fsdp.override_optimizer_config) == (
        None,
        0.5,
        None,
        None,
    )
    mcore = McoreOptimizerConfig()
    assert (mcore.optimizer, mcore.lr_decay_style, mcore.lr_decay_steps, mcore.min_lr) == (
        "adam",
        "constant",
        None,
        0.0,
    )
    assert (mcore.lr_wsd_decay_style, mcore.override_optimizer_config) == ("exponential", {})
    assert not hasattr(mcore, "optimizer_impl") and not hasattr(fsdp, "lr_decay_style")


def test_fsdp_engine_section_builds_with_the_yaml_defaults():
    built = omega_conf_to_dataclass(compose("ppo_trainer").actor_rollout_ref.actor.fsdp_config)
    assert type(built) is FSDPEngineConfig
    assert _without_target(built) == _without_target(FSDPEngineConfig())
    assert (built.wrap_policy, built.fsdp_size, built.model_dtype, built.dtype) == (
        {"min_num_params": 0},
        -1,
        "fp32",
        "bfloat16",
    )
    critic = omega_conf_to_dataclass(compose("ppo_trainer").critic.model.fsdp_config)
    assert type(critic) is FSDPEngineConfig


def test_the_schedule_length_may_be_filled_in_later_but_the_learning_rate_may_not():
    optim = FSDPOptimizerConfig(lr=1e-6)
    optim.total_training_steps = 20  # upstream's `_mutable_fields`: the trainer knows the run length
    assert optim.total_training_steps == 20
    with pytest.raises(dataclasses.FrozenInstanceError):
        optim.lr = 1.0


def test_the_older_warmup_style_wins_as_upstream():
    assert FSDPOptimizerConfig(warmup_style="cosine").lr_scheduler_type == "cosine"
    assert FSDPOptimizerConfig(lr_scheduler_type="cosine").lr_scheduler_type == "cosine"


@pytest.mark.parametrize(
    "cls, kwargs, match",
    [
        (FSDPOptimizerConfig, {"lr": 0.0}, r"optim\.lr=0\.0 must be > 0"),
        (McoreOptimizerConfig, {"lr": -1e-5}, r"optim\.lr=-1e-05 must be > 0"),
        (FSDPOptimizerConfig, {"lr_warmup_steps_ratio": 1.5}, r"optim\.lr_warmup_steps_ratio=1\.5 must be between 0"),
        (FSDPOptimizerConfig, {"lr_scheduler_type": "linear"}, r"lr_scheduler_type='linear' is not a schedule here"),
        (McoreOptimizerConfig, {"lr_decay_style": "WSD"}, r"lr_decay_style='WSD' is not a schedule here"),
    ],
)
def test_a_bad_optimizer_value_is_refused_when_built(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls(**kwargs)


@pytest.mark.parametrize("name", ["arith_demo", "arith_demo_megatron"])
@pytest.mark.parametrize("role", ["actor_rollout_ref.actor", "critic"])
def test_the_validator_names_the_roles_key_for_a_section_check(name, role):
    cfg = OmegaConf.to_container(compose(name), resolve=True)
    node = cfg
    for part in role.split("."):
        node = node[part]
    node["optim"]["lr_warmup_steps_ratio"] = 2.0
    with pytest.raises(ConfigError, match=rf"{role}\.optim\.lr_warmup_steps_ratio=2\.0 must be between 0 and 1"):
        validate_ppo_config(cfg)


def test_a_key_of_the_other_engines_optimizer_is_unknown_with_a_hint():
    cfg = OmegaConf.to_container(compose("arith_demo"), resolve=True)
    bad = copy.deepcopy(cfg)
    bad["actor_rollout_ref"]["actor"]["optim"]["lr_decay_style"] = "cosine"  # a Megatron key on an FSDP section
    with pytest.raises(ConfigError, match=r"unknown config key 'actor_rollout_ref\.actor\.optim\.lr_decay_style'"):
        validate_ppo_config(bad)
    bad = copy.deepcopy(cfg)
    bad["actor_rollout_ref"]["actor"]["optim"]["optimizer_imp"] = "torch.optim"
    with pytest.raises(ConfigError, match=r"optimizer_imp.*optimizer_impl"):
        validate_ppo_config(bad)


def test_subclass_only_keys_are_listed_for_the_docs_and_hints():
    keys = set(schema_keys())
    assert {"actor_rollout_ref.actor.optim.optimizer_impl", "actor_rollout_ref.actor.optim.lr_decay_style"} <= keys
    assert {"critic.optim.num_cycles", "critic.optim.min_lr"} <= keys
    page = render()  # marked with the composition that holds them, as other optional keys are
    assert "| `optimizer_impl` | str | `torch.optim` | yes | *fsdp* " in page
    assert "| `lr_decay_style` | str | `constant` | yes | *megatron* " in page
    assert "| `optimizer` | str | `AdamW` | yes | Optimizer class" in page  # both engines' classes have it
    assert issubclass(FSDPOptimizerConfig, OptimizerConfig) and issubclass(McoreOptimizerConfig, OptimizerConfig)


# ------------------------------------------------------------- actor, critic, rollout, model sections


def _leaves(config, prefix: str = "") -> dict:
    """Dotted key -> value of a built section, nested sections flattened, `_target_` left out."""
    out = {}
    for key, value in dataclasses.asdict(config).items() if prefix == "" else config.items():
        if key == "_target_":
            continue
        if isinstance(value, dict) and value and all(isinstance(k, str) for k in value):
            out.update(_leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


@pytest.mark.parametrize(
    "name, path, cls, set_by_yaml",
    [
        # the YAML gives each role its own learning rate; the FSDP actor's use_remove_padding follows the model's;
        # optim/fsdp.yaml writes min_lr_ratio 0.0 where upstream's dataclass default is null (both read as 0)
        (
            "ppo_trainer",
            "actor_rollout_ref.actor",
            FSDPActorConfig,
            {"optim.lr": 1e-6, "optim.min_lr_ratio": 0.0, "use_remove_padding": True},
        ),
        ("ppo_megatron_trainer", "actor_rollout_ref.actor", McoreActorConfig, {"optim.lr": 1e-6}),
        ("ppo_trainer", "critic", FSDPCriticConfig, {"optim.lr": 1e-5, "optim.min_lr_ratio": 0.0}),
        (
            "ppo_trainer",
            "actor_rollout_ref.rollout",
            RolloutConfig,
            # name: every run must choose; trace.*: follow trainer.project_name / experiment_name (upstream v0.9.0)
            {"name": "???", "trace.project_name": "verl_examples", "trace.experiment_name": "gsm8k"},
        ),
        ("ppo_trainer", "actor_rollout_ref.model", HFModelConfig, {}),
    ],
)
def test_each_role_section_builds_its_class_and_differs_from_the_defaults_only_where_the_yaml_says(
    name, path, cls, set_by_yaml
):
    section = compose(name)
    for part in path.split("."):
        section = section[part]
    # an actor needs a micro-batch size (upstream's rule), which its YAML leaves to the run (null)
    required = {"ppo_micro_batch_size_per_gpu": 4} if path.endswith(".actor") else {}
    section.update(required)
    built = omega_conf_to_dataclass(section)
    assert type(built) is cls
    got, default = _leaves(built), _leaves(cls(**required))
    differs = {key: got[key] for key in got if got[key] != default.get(key)}
    assert differs == set_by_yaml


def test_role_section_defaults_are_upstreams():
    # upstream's release dataclasses and YAML, written out by hand
    actor = FSDPActorConfig(ppo_micro_batch_size_per_gpu=4)
    assert (actor.strategy, actor.ppo_mini_batch_size, actor.ppo_max_token_len_per_gpu) == ("fsdp", 256, 16384)
    assert (actor.clip_ratio, actor.clip_ratio_low, actor.clip_ratio_high, actor.clip_ratio_c) == (0.2, 0.2, 0.2, 3.0)
    assert (actor.loss_agg_mode, actor.kl_loss_coef, actor.kl_loss_type) == ("token-mean", 0.001, "low_var_kl")
    assert (actor.ppo_epochs, actor.grad_clip, actor.ulysses_sequence_parallel_size) == (1, 1.0, 1)
    assert type(actor.optim) is FSDPOptimizerConfig and type(actor.fsdp_config) is FSDPEngineConfig
    mcore = McoreActorConfig(use_dynamic_bsz=True)
    assert (mcore.strategy, mcore.load_weight, type(mcore.optim)) == ("megatron", True, McoreOptimizerConfig)
    assert not hasattr(mcore, "fsdp_config") and not hasattr(actor, "megatron")
    critic = FSDPCriticConfig()
    assert (critic.cliprange_value, critic.ppo_max_token_len_per_gpu, critic.grad_clip) == (0.5, 32768, 1.0)
    assert (McoreCriticConfig().strategy, McoreCriticConfig().nccl_timeout) == ("megatron", 600)
    rollout = RolloutConfig()
    assert (rollout.mode, rollout.temperature, rollout.top_k, rollout.top_p) == ("async", 1.0, -1, 1.0)
    # max_num_seqs: upstream's YAML value (its dataclass says 1024; the YAML is what its runs get)
    assert (rollout.gpu_memory_utilization, rollout.max_num_batched_tokens, rollout.max_num_seqs) == (0.5, 8192, 256)
    assert (rollout.load_format, rollout.val_kwargs.n, rollout.multi_turn.max_tool_response_length) == ("dummy", 1, 256)
    assert (rollout.agent.default_agent_loop, rollout.multi_turn.format) == ("single_turn_agent", "hermes")
    model = HFModelConfig()
    assert (model.lora_rank, model.lora_alpha, model.target_modules) == (0, 16, "all-linear")
    assert (model.enable_gradient_checkpointing, model.use_remove_padding, model.mtp.enable) == (True, True, False)
    assert issubclass(FSDPActorConfig, ActorConfig) and issubclass(McoreCriticConfig, CriticConfig)


@pytest.mark.parametrize(
    "cls, kwargs, match",
    [
        (FSDPActorConfig, {"ppo_epochs": 0}, r"^actor\.ppo_epochs=0 must be at least 1$"),
        (McoreActorConfig, {"ppo_mini_batch_size": 0}, r"^actor\.ppo_mini_batch_size=0 must be at least 1$"),
        (FSDPActorConfig, {"clip_ratio_c": 1.0}, r"^actor\.clip_ratio_c=1\.0 must be > 1 \(dual-clip bound"),
        (RolloutConfig, {"n": 0}, r"^rollout\.n=0 must be at least 1$"),
        (RolloutConfig, {"temperature": 0.0}, r"^rollout\.do_sample=true with temperature=0\.0 cannot sample"),
        (
            RolloutConfig,
            {"val_kwargs": SamplingConfig(do_sample=True, temperature=0.0)},
            r"^rollout\.val_kwargs\.do_sample=true with temperature=0\.0 cannot sample",
        ),
    ],
)
def test_a_bad_role_value_is_refused_when_built(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls(**kwargs)


def test_multi_turn_limits_are_checked_only_when_multi_turn_runs():
    assert MultiTurnConfig(max_assistant_turns=0).max_assistant_turns == 0  # off: the limits are not read
    with pytest.raises(ValueError, match=r"^multi_turn\.max_assistant_turns=0 must be >= 1, or null for no limit$"):
        MultiTurnConfig(enable=True, max_assistant_turns=0)
    with pytest.raises(ValueError, match=r"^multi_turn\.max_parallel_calls=0 must be >= 1$"):
        MultiTurnConfig(enable=True, max_parallel_calls=0)


def test_lora_keys_are_checked_only_for_fresh_adapters():
    with pytest.raises(ValueError, match=r"^model\.lora_rank=-1 must be 0"):
        HFModelConfig(lora_rank=-1)
    with pytest.raises(ValueError, match=r"^model\.target_modules is empty, so LoRA would adapt nothing"):
        HFModelConfig(lora_rank=8, target_modules=[])
    assert HFModelConfig(lora_rank=0, lora_alpha=0).lora_alpha == 0  # no LoRA: alpha is not read
    # a trained adapter brings its own rank, alpha and modules
    assert HFModelConfig(lora_rank=8, lora_alpha=0, lora_adapter_path="/adapter").lora_alpha == 0


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("actor_rollout_ref.actor.ppo_epochs", 0, "actor_rollout_ref.actor.ppo_epochs=0 must be at least 1"),
        ("actor_rollout_ref.rollout.n", 0, "actor_rollout_ref.rollout.n=0 must be at least 1"),
        (
            "actor_rollout_ref.rollout.temperature",
            0.0,
            "actor_rollout_ref.rollout.do_sample=true with temperature=0.0 cannot sample",
        ),
        (
            "actor_rollout_ref.model.lora_rank",
            -1,
            "actor_rollout_ref.model.lora_rank=-1 must be 0 (train all weights) or a positive LoRA rank",
        ),
        # a nested section's check is reported once, under its own key (not again by the actor that holds it)
        ("actor_rollout_ref.actor.optim.lr", 0.0, "actor_rollout_ref.actor.optim.lr=0.0 must be > 0"),
    ],
)
def test_the_validator_reports_a_role_sections_check_once_under_the_full_key(key, value, message):
    cfg = OmegaConf.to_container(compose("arith_demo"), resolve=True)
    node = cfg
    *parents, leaf = key.split(".")
    for part in parents:
        node = node[part]
    node[leaf] = value
    with pytest.raises(ConfigError) as info:
        validate_ppo_config(cfg)
    assert str(info.value).count(message) == 1, str(info.value)
    # the same check under a shorter (wrong) key would repeat the text after the section's name
    assert str(info.value).count(message[len(".".join(parents)) + 1 :]) == 1, str(info.value)


def test_a_megatron_engine_check_is_reported_once_under_the_full_key():
    cfg = OmegaConf.to_container(compose("arith_demo_megatron"), resolve=True)
    cfg["actor_rollout_ref"]["actor"]["megatron"]["tensor_model_parallel_size"] = 0
    with pytest.raises(ConfigError) as info:
        validate_ppo_config(cfg)
    text = str(info.value)
    assert text.count("tensor_model_parallel_size=0") == 1, text
    assert "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=0" in text


def test_an_unknown_tool_format_lists_the_parsers():
    cfg = OmegaConf.to_container(compose("arith_demo"), resolve=True)
    cfg["actor_rollout_ref"]["rollout"]["multi_turn"]["format"] = "hermez"
    with pytest.raises(ConfigError, match=r"multi_turn\.format='hermez' is not a valid choice.*hermes"):
        validate_ppo_config(cfg)


def test_engine_only_keys_of_the_role_sections_are_listed_under_their_subclass():
    fields = {f.name: owner for f, owner, _ in section_fields(ActorConfig)}
    assert fields["grad_clip"] is FSDPActorConfig and fields["fsdp_config"] is FSDPActorConfig
    assert fields["megatron"] is McoreActorConfig and fields["ppo_epochs"] is ActorConfig
    critic = {f.name: owner for f, owner, _ in section_fields(CriticConfig)}
    assert (
        critic["nccl_timeout"] is McoreCriticConfig and critic["forward_micro_batch_size_per_gpu"] is FSDPCriticConfig
    )


def test_the_validator_names_a_multi_turn_limit_by_its_full_key_once():
    cfg = OmegaConf.to_container(compose("arith_demo"), resolve=True)
    cfg["actor_rollout_ref"]["rollout"]["multi_turn"].update(enable=True, max_user_turns=0)
    with pytest.raises(ConfigError) as info:
        validate_ppo_config(cfg)
    text = str(info.value)
    assert text.count("max_user_turns=0 must be >= 1") == 1, text
    assert "actor_rollout_ref.rollout.multi_turn.max_user_turns=0 must be >= 1, or null for no limit" in text
