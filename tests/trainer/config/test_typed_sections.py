"""Typed config sections (algorithm, checkpoint): built from the YAML by `_target_`, upstream's defaults, own checks."""

from __future__ import annotations

import copy
import dataclasses
import sys
import types

import pytest
from omegaconf import OmegaConf

from verl.trainer.config import (
    AlgoConfig,
    CheckpointConfig,
    ConfigError,
    FilterGroupsConfig,
    KLControlConfig,
    RolloutCorrectionConfig,
    validate_ppo_config,
)
from verl.trainer.config import schema as S
from verl.trainer.config.algorithm import PFPPOConfig
from verl.trainer.config.loader import compose
from verl.trainer.config.validate import iter_schema_fields
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config import (
    FSDPOptimizerConfig,
    McoreCheckpointConfig,
    McoreEngineConfig,
    McoreOptimizerConfig,
    PolicyLossConfig,
)
from verl.workers.config._fields import doc


def _without_targets(value):
    if isinstance(value, dict):
        return {k: _without_targets(v) for k, v in value.items() if k != "_target_"}
    return value


@pytest.mark.parametrize("name", ["ppo_trainer", "ppo_megatron_trainer"])
def test_algorithm_section_builds_algo_config_with_upstreams_defaults(name):
    algo = omega_conf_to_dataclass(compose(name).algorithm)
    assert type(algo) is AlgoConfig and type(algo.kl_ctrl) is KLControlConfig
    assert type(algo.filter_groups) is FilterGroupsConfig
    assert type(algo.rollout_correction) is RolloutCorrectionConfig
    # upstream's release defaults, written out by hand
    assert (algo.gamma, algo.lam, algo.adv_estimator, algo.norm_adv_by_std_in_grpo) == (1.0, 1.0, "gae", True)
    assert (algo.use_kl_in_reward, algo.kl_penalty, algo.use_pf_ppo) == (False, "kl", False)
    assert (algo.kl_ctrl.type, algo.kl_ctrl.kl_coef, algo.kl_ctrl.horizon, algo.kl_ctrl.target_kl) == (
        "fixed",
        0.001,
        10000,
        0.1,
    )
    assert (algo.pf_ppo.reweight_method, algo.pf_ppo.weight_pow) == ("pow", 2.0)
    assert algo.rollout_correction.rollout_is is None and algo.rollout_correction.rollout_is_threshold == 2.0


def test_dataclass_defaults_equal_the_yaml_defaults():
    """One definition: building with no config gives what the YAML gives (only `_target_` differs), except
    `pf_ppo`, which is upstream's empty dict ("not set") until PF-PPO is switched on."""
    from_yaml = _without_targets(dataclasses.asdict(omega_conf_to_dataclass(compose("ppo_trainer").algorithm)))
    built = _without_targets(dataclasses.asdict(AlgoConfig()))
    assert built.pop("pf_ppo") == {} and from_yaml.pop("pf_ppo") == {"reweight_method": "pow", "weight_pow": 2.0}
    assert built == from_yaml
    assert _without_targets(dataclasses.asdict(AlgoConfig(use_pf_ppo=True).pf_ppo)) == {
        "reweight_method": "pow",
        "weight_pow": 2.0,
    }


def test_pf_ppo_is_an_empty_dict_until_set_and_a_checked_section_once_set():
    assert AlgoConfig(gamma=0.9).pf_ppo == {} and not AlgoConfig().pf_ppo  # upstream's "not set"
    given = AlgoConfig(pf_ppo={"reweight_method": "max_min"}).pf_ppo
    assert isinstance(given, PFPPOConfig) and (given.reweight_method, given.weight_pow) == ("max_min", 2.0)
    on = AlgoConfig(use_pf_ppo=True).pf_ppo  # PF-PPO on with nothing set: the YAML's defaults
    assert isinstance(on, PFPPOConfig) and (on.reweight_method, on.weight_pow) == ("pow", 2.0)
    with pytest.raises(ValueError, match=r"algorithm.pf_ppo has unknown key\(s\) \['weight'\]"):
        AlgoConfig(pf_ppo={"weight": 3.0})
    with pytest.raises(ValueError, match=r"reweight_method='sqrt' is not a valid choice"):
        AlgoConfig(pf_ppo={"reweight_method": "sqrt"})


def test_algo_config_is_frozen_and_reads_like_a_mapping():
    algo = AlgoConfig(gamma=0.99)
    with pytest.raises(dataclasses.FrozenInstanceError):
        algo.gamma = 0.5
    assert algo["gamma"] == 0.99 and algo.get("lam") == 1.0 and algo.kl_ctrl.get("kl_coef") == 0.001
    assert algo.get("no_such_key", "fallback") == "fallback"


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"gamma": 1.5}, r"algorithm.gamma=1.5 is outside \[0, 1\]"),
        ({"lam": -0.1}, r"algorithm.lam=-0.1 is outside \[0, 1\]"),
        ({"kl_penalty": "k9"}, r"algorithm.kl_penalty='k9' is not a valid choice; use one of: kl, k1"),
        ({"kl_ctrl": {"kl_coef": -0.01}}, r"algorithm.kl_ctrl.kl_coef=-0.01 is negative"),
        (
            {"kl_ctrl": {"type": "pid"}},
            r"algorithm.kl_ctrl.type='pid' is not a valid choice; use one of: fixed, adaptive",
        ),
        (
            {"kl_ctrl": {"type": "adaptive", "horizon": 0}},
            r"type=adaptive needs target_kl > 0 and horizon > 0 \(got target_kl=0.1, horizon=0\)",
        ),
        ({"filter_groups": {"enable": True}}, r"filter_groups.enable=true needs algorithm.filter_groups.metric"),
        ({"pf_ppo": {"reweight_method": "sqrt"}}, r"algorithm.pf_ppo.reweight_method='sqrt' is not a valid choice"),
    ],
)
def test_per_field_checks_run_when_the_section_is_built(overrides, match):
    with pytest.raises(ValueError, match=match):
        omega_conf_to_dataclass(overrides, AlgoConfig)


def test_boundary_values_are_accepted():
    algo = omega_conf_to_dataclass({"gamma": 0.0, "lam": 1.0, "kl_ctrl": {"kl_coef": 0.0}}, AlgoConfig)
    assert (algo.gamma, algo.lam, algo.kl_ctrl.kl_coef) == (0.0, 1.0, 0.0)
    assert FilterGroupsConfig(enable=True, metric="acc").metric == "acc"


@pytest.mark.parametrize("name", ["ppo_trainer", "ppo_megatron_trainer"])
@pytest.mark.parametrize("section", ["actor_rollout_ref.actor.checkpoint", "critic.checkpoint"])
def test_checkpoint_sections_build_checkpoint_config(name, section):
    from omegaconf import OmegaConf

    ckpt = omega_conf_to_dataclass(OmegaConf.select(compose(name), section))
    # upstream v0.9's Megatron critic names the Megatron subclass (its mbridge_config)
    expected = (
        McoreCheckpointConfig if (name, section) == ("ppo_megatron_trainer", "critic.checkpoint") else CheckpointConfig
    )
    assert type(ckpt) is expected
    # load_contents follows save_contents by interpolation in the YAML
    assert ckpt.save_contents == ckpt.load_contents == ["model", "optimizer", "extra"] and ckpt.async_save is False
    assert dataclasses.replace(ckpt, _target_="") == expected()


def test_checkpoint_config_refuses_unknown_parts():
    with pytest.raises(ValueError, match=r"checkpoint.save_contents has unknown part\(s\) \['weights'\]"):
        CheckpointConfig(save_contents=["model", "weights"])


@pytest.mark.parametrize("name", ["ppo_trainer", "ppo_megatron_trainer"])
def test_policy_loss_section_builds_policy_loss_config_with_upstreams_defaults(name):
    loss = omega_conf_to_dataclass(compose(name).actor_rollout_ref.actor.policy_loss)
    assert type(loss) is PolicyLossConfig
    # upstream's release defaults, written out by hand
    assert (loss.loss_mode, loss.clip_cov_ratio, loss.clip_cov_lb, loss.clip_cov_ub) == ("vanilla", 0.0002, 1.0, 5.0)
    assert (loss.kl_cov_ratio, loss.ppo_kl_coef) == (0.0002, 0.1)
    assert dataclasses.replace(loss, _target_="") == PolicyLossConfig()


def test_policy_loss_accepts_every_registered_mode_and_upstreams_hyphenated_spelling():
    from verl.algorithms.policy_losses import POLICY_LOSSES

    for mode in POLICY_LOSSES:
        extra = {"dro_beta": 0.1} if mode == "dro" else {}  # dro needs its penalty weight
        assert PolicyLossConfig(loss_mode=mode, **extra).loss_mode == mode
    assert PolicyLossConfig(loss_mode="clip-cov").loss_mode == "clip-cov"


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"loss_mode": "ppo2"}, r"policy_loss.loss_mode='ppo2' is not a valid choice; use one of: vanilla"),
        ({"clip_cov_ratio": 1.5}, r"policy_loss.clip_cov_ratio=1.5 is outside \[0, 1\]"),
        ({"kl_cov_ratio": -0.1}, r"policy_loss.kl_cov_ratio=-0.1 is outside \[0, 1\]"),
        ({"clip_cov_lb": 6.0}, r"policy_loss.clip_cov_lb=6.0 is above clip_cov_ub=5.0"),
    ],
)
def test_policy_loss_checks_run_when_the_section_is_built(overrides, match):
    with pytest.raises(ValueError, match=match):
        omega_conf_to_dataclass(overrides, PolicyLossConfig)


def test_a_bad_policy_loss_value_fails_validation_naming_the_full_key():
    from omegaconf import OmegaConf

    from verl.trainer.config import ConfigError, load_ppo_config, validate_ppo_config

    cfg = OmegaConf.to_container(load_ppo_config(config_name="arith_demo"), resolve=True)
    cfg["actor_rollout_ref"]["actor"]["policy_loss"]["clip_cov_ratio"] = 2.0
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.actor\.policy_loss\.clip_cov_ratio=2.0 is outside"):
        validate_ppo_config(cfg)


@pytest.mark.parametrize(
    "section",
    ["actor_rollout_ref.actor.megatron", "actor_rollout_ref.ref.megatron", "critic.megatron"],
)
def test_megatron_sections_build_mcore_engine_config_with_upstreams_defaults(section):
    from omegaconf import OmegaConf

    engine = omega_conf_to_dataclass(OmegaConf.select(compose("ppo_megatron_trainer"), section))
    assert type(engine) is McoreEngineConfig
    # upstream's engine/megatron.yaml, written out by hand
    assert (engine.tensor_model_parallel_size, engine.pipeline_model_parallel_size) == (1, 1)
    assert (engine.context_parallel_size, engine.expert_model_parallel_size) == (1, 1)
    assert engine.virtual_pipeline_model_parallel_size is None and engine.expert_tensor_parallel_size is None
    # the YAML's sequence_parallel is true; with tensor parallel size 1 the built section holds false (as upstream's)
    assert OmegaConf.select(compose("ppo_megatron_trainer"), section + ".sequence_parallel") is True
    assert (engine.sequence_parallel, engine.use_distributed_optimizer, engine.seed) == (False, True, 42)
    assert engine.override_transformer_config["recompute_modules"] == ["core_attn"]


def test_mcore_engine_defaults_equal_the_actors_yaml_section():
    from_yaml = omega_conf_to_dataclass(compose("ppo_megatron_trainer").actor_rollout_ref.actor.megatron)
    assert dataclasses.replace(from_yaml, _target_="") == McoreEngineConfig()


def test_the_fsdp_composition_has_no_megatron_section_to_build():
    assert "megatron" not in compose("ppo_trainer").actor_rollout_ref.actor


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"tensor_model_parallel_size": 0}, r"megatron.tensor_model_parallel_size=0 must be a positive integer"),
        ({"context_parallel_size": -2}, r"megatron.context_parallel_size=-2 must be a positive integer"),
        (
            {"virtual_pipeline_model_parallel_size": 2},
            r"virtual_pipeline_model_parallel_size=2 needs pipeline_model_parallel_size >= 2 \(got 1\)",
        ),
    ],
)
def test_mcore_engine_checks_run_when_the_section_is_built(overrides, match):
    with pytest.raises(ValueError, match=match):
        omega_conf_to_dataclass(overrides, McoreEngineConfig)
    assert (
        McoreEngineConfig(
            pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2
        ).pipeline_model_parallel_size
        == 2
    )


@dataclasses.dataclass
class _TaggedCheckpointConfig(CheckpointConfig):
    """A subclass with one key of its own: the schema must check a section against the class its `_target_` names."""

    tag: str = doc("A label.", default="none")


@pytest.mark.parametrize("name", ["arith_demo", "arith_demo_megatron"])  # ppo_trainer, ppo_megatron_trainer
def test_schema_checks_a_section_against_the_subclass_its_target_names(name):
    from omegaconf import OmegaConf

    from verl.trainer.config import ConfigError, load_ppo_config, validate_ppo_config
    from verl.trainer.config.schema import section_class

    def config(**checkpoints):
        cfg = OmegaConf.to_container(load_ppo_config(config_name=name), resolve=True)
        cfg["actor_rollout_ref"]["actor"]["checkpoint"].update(checkpoints.get("actor", {}))
        cfg["critic"]["checkpoint"].update(checkpoints.get("critic", {}))
        return cfg

    tagged = {"_target_": f"{__name__}._TaggedCheckpointConfig", "tag": "x"}
    # the subclass declares `tag`, so the walk accepts it ...
    cfg = config(actor=tagged)
    validate_ppo_config(cfg)
    section = cfg["actor_rollout_ref"]["actor"]["checkpoint"]
    assert section_class(CheckpointConfig, section) is _TaggedCheckpointConfig
    assert omega_conf_to_dataclass(section).tag == "x"
    # ... while the base class, which the critic's section still names, does not
    with pytest.raises(ConfigError, match=r"unknown config key 'critic\.checkpoint\.tag'"):
        validate_ppo_config(config(actor=tagged, critic={"tag": "x"}))
    # a `_target_` that is not a subclass of the declared class is reported under its own key
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.actor\.checkpoint\._target_=.*not a CheckpointConfig"):
        validate_ppo_config(config(actor={"_target_": "verl.trainer.config.AlgoConfig"}))
    assert section_class(CheckpointConfig, {"save_contents": []}) is CheckpointConfig


# ------------------------------------------------------- the schema picks a section's class by `_target_`


@dataclasses.dataclass
class _ShiftedFSDPOptim(FSDPOptimizerConfig):
    """A stand-in FSDP optimizer subclass with one key of its own (the schema must then accept it)."""

    shift: int = doc("A key only this subclass declares.", default=0)


@dataclasses.dataclass
class _ShiftedMcoreOptim(McoreOptimizerConfig):
    """The same for a Megatron optimizer section."""

    shift: int = doc("A key only this subclass declares.", default=0)


_SHIFTED = {"ppo_trainer": _ShiftedFSDPOptim, "ppo_megatron_trainer": _ShiftedMcoreOptim}


@pytest.fixture
def shifted_optim_module(monkeypatch):
    module = types.ModuleType("m4_shifted_optim")
    for cls in _SHIFTED.values():
        setattr(module, cls.__name__, cls)
    monkeypatch.setitem(sys.modules, "m4_shifted_optim", module)
    return "m4_shifted_optim"


def test_section_class_is_the_declared_class_without_target():
    assert S.section_class(S.OptimizerConfig, {"lr": 1.0}) is S.OptimizerConfig
    assert S.section_class(S.OptimizerConfig, None) is S.OptimizerConfig


@pytest.mark.parametrize("name", ["ppo_trainer", "ppo_megatron_trainer"])
def test_target_chooses_the_subclass_whose_keys_are_checked(name, shifted_optim_module):
    cfg = OmegaConf.to_container(compose(name), resolve=True)
    optim = cfg["actor_rollout_ref"]["actor"]["optim"]
    optim["shift"] = 3
    # the YAML's `_target_` (the engine's optimizer class) has no `shift`: an unknown key
    with pytest.raises(ConfigError, match=r"unknown config key 'actor_rollout_ref\.actor\.optim\.shift'"):
        validate_ppo_config(copy.deepcopy(cfg))
    shifted = _SHIFTED[name]
    optim["_target_"] = f"{shifted_optim_module}.{shifted.__name__}"
    assert S.section_class(S.OptimizerConfig, optim) is shifted
    assert omega_conf_to_dataclass(optim).shift == 3
    try:
        validate_ppo_config(cfg)
    except ConfigError as e:  # the stock config may fail other rules; `shift` must not be among them
        assert "optim.shift" not in str(e) and "optim._target_" not in str(e), str(e)
    # the subclass's own key is required like any other declared key
    del optim["shift"]
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.actor\.optim\.shift is missing"):
        validate_ppo_config(cfg)


@pytest.mark.parametrize("name", ["ppo_trainer", "ppo_megatron_trainer"])
def test_target_naming_a_foreign_class_is_refused(name):
    cfg = OmegaConf.to_container(compose(name), resolve=True)
    cfg["actor_rollout_ref"]["actor"]["optim"]["_target_"] = "verl.trainer.config.AlgoConfig"
    with pytest.raises(
        ConfigError,
        # the actor's class (FSDPActorConfig / McoreActorConfig) declares its engine's optimizer class
        match=r"optim\._target_='verl\.trainer\.config\.AlgoConfig' names AlgoConfig, "
        r"which is not a (FSDP|Mcore)OptimizerConfig",
    ):
        validate_ppo_config(cfg)
    cfg["actor_rollout_ref"]["actor"]["optim"]["_target_"] = "verl.nowhere.Optim"
    with pytest.raises(ConfigError, match=r"optim\._target_='verl\.nowhere\.Optim' does not name an importable class"):
        validate_ppo_config(cfg)


def test_yaml_targets_resolve_to_the_class_the_schema_declares_or_a_subclass():
    """Every `_target_` in both trainers' composed YAML names a subclass of the schema's declared class."""
    for name in ("ppo_trainer", "ppo_megatron_trainer"):
        cfg = OmegaConf.to_container(compose(name), resolve=True)
        seen = 0
        for key, _f, tp, _owner in iter_schema_fields():
            node = cfg
            for part in key.split("."):
                node = node.get(part) if isinstance(node, dict) else None
            if isinstance(node, dict) and "_target_" in node and dataclasses.is_dataclass(tp):
                assert issubclass(S.section_class(tp, node, key), tp)
                seen += 1
        assert seen >= 3, (name, seen)
