"""Upstream's asynchronous entry points (`verl.experimental.one_step_off_policy.main_ppo`,
`verl.experimental.fully_async_policy.fully_async_main`): their configs, the translation of upstream's
keys into verl's asynchronous training (verl/trainer/config/async_recipes.py), and every upstream launch
script that calls them (upstream/async_scripts.yaml), composed, translated and checked as the entry
points do before Ray starts."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import pytest
import yaml

from verl.experimental.fully_async_policy.fully_async_main import ENTRY as FULLY_ASYNC
from verl.experimental.one_step_off_policy.main_ppo import ENTRY as ONE_STEP_OFF
from verl.trainer.config import ConfigError, ConfigWarning, load_ppo_config, parse_command_line

SCRIPTS = yaml.safe_load((Path(__file__).parent / "upstream" / "async_scripts.yaml").read_text())
ENTRIES = {
    "verl.experimental.one_step_off_policy.main_ppo": ONE_STEP_OFF,
    "verl.experimental.fully_async_policy.fully_async_main": FULLY_ASYNC,
}
S = "volcengine/verl:verl/experimental/"
# Scripts refused, with the start of the reason; every other one composes, translates and validates.
REFUSED = {
    # upstream's release has no such config either (its entry point fails the same way)
    f"{S}fully_async_policy/shell/dapo_30b_a3b_base_math_fsdp.sh": "cannot compose config 'fully_async_dapo_trainer'",
    # 128 prompts x 16 samples do not split over 12 trainer ranks (upstream's dispatch fails when it starts)
    f"{S}fully_async_policy/shell/dapo_7b_math_fsdp2_4_12.sh": "data.train_batch_size x actor_rollout_ref.rollout.n = 128 x 16 = 2048 sequences per step is not divisible by the 12 workers",
    # the proximal log-probs of the sync window's first weights
    f"{S}fully_async_policy/shell/dapo_7b_math_fsdp2_64_64_mis.sh": "async_training.compute_prox_log_prob=True with trigger_parameter_sync_step=4",
    f"{S}fully_async_policy/shell/grpo_30b_a3b_base_math_megatron_96_32_mis.sh": "async_training.compute_prox_log_prob=True with trigger_parameter_sync_step=4",
}  # fmt: skip


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    """Stand-ins for the files the config check opens (the ReTool script's reward function and tools)."""
    tmp = tmp_path_factory.mktemp("files")
    (tmp / "reward.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n"
    )
    (tmp / "tools.yaml").write_text("tools: []\n")
    return {"custom_reward_function.path": str(tmp / "reward.py"), "tool_config_path": str(tmp / "tools.yaml")}


def _load(entry, args: list[str], files: dict | None = None):
    out = []
    for arg in args:
        key = arg.split("=", 1)[0]
        match = [v for k, v in (files or {}).items() if key.endswith(k)]
        out.append(f"{key}={match[0]}" if match else arg)
    cmd = parse_command_line(out, **entry.command_line())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        return load_ppo_config(cmd.overrides, cmd.config_dir, config_name=cmd.config_name, translate=entry.translate)


@pytest.mark.parametrize(
    "script", SCRIPTS, ids=[s["script"].split("/")[-3] + "/" + s["script"].split("/")[-1] for s in SCRIPTS]
)
def test_upstream_async_launch_script(script, files):
    entry = ENTRIES[script["module"]]
    if script["script"] in REFUSED:
        with pytest.raises(ConfigError) as e:
            _load(entry, script["args"], files)
        assert REFUSED[script["script"]] in str(e.value), str(e.value)
        return
    cfg = _load(entry, script["args"], files)
    assert cfg.async_training.staleness_threshold > 0 and cfg.actor_rollout_ref.hybrid_engine
    assert "require_batches" not in cfg.async_training and "total_rollout_steps" not in cfg.rollout


def _fully_async_8_8() -> list[str]:
    (script,) = [s for s in SCRIPTS if s["script"].endswith("fully_async_policy/shell/dapo_7b_math_fsdp2_8_8.sh")]
    return script["args"]


def test_fully_async_keys_become_verl_s_asynchronous_training(caplog):
    args = _fully_async_8_8()
    # the script's own values, which the numbers below are worked from
    for value in (
        "actor_rollout_ref.actor.ppo_mini_batch_size=32",
        "async_training.require_batches=4",
        "async_training.staleness_threshold=0.1",
        "async_training.trigger_parameter_sync_step=4",
        "rollout.total_rollout_steps=51200",
        "rollout.test_freq=10",
        "data.train_batch_size=0",
        "actor_rollout_ref.hybrid_engine=False",
    ):
        assert value in args
    with caplog.at_level(logging.WARNING, logger="verl.trainer.config.async_recipes"):
        cfg = _load(FULLY_ASYNC, [*args, "trainer.save_freq=5"])
    assert cfg.data.train_batch_size == 32 * 4  # upstream's required_samples
    # (1 + 0.1) x 4 steps' prompts per weight version: 4.4 batches from the sync, i.e. 3.4 beyond the current one
    assert cfg.async_training.staleness_threshold == pytest.approx(3.4)
    assert cfg.async_training.trigger_parameter_sync_step == 4
    assert cfg.async_training.off_policy_correction == "tis"  # use_rollout_log_probs=True
    assert cfg.async_training.partial_rollout is True
    assert cfg.trainer.total_training_steps == 51200 // 128
    assert cfg.trainer.test_freq == 10 * 4 and cfg.trainer.save_freq == 5 * 4  # weight versions -> steps
    assert cfg.trainer.total_epochs == 10  # min(trainer.total_epochs=10 of the script, rollout.total_epochs=10)
    assert cfg.actor_rollout_ref.hybrid_engine is True
    for section, key in (
        ("async_training", "checkpoint_engine"),
        ("actor_rollout_ref", "checkpoint_engine"),
        ("rollout", "n"),
    ):
        assert key not in cfg[section]
    assert "use_rollout_log_probs" not in cfg.actor_rollout_ref.actor
    assert "128 prompts per step" in caplog.text and "off_policy_correction=tis" in caplog.text


def test_fully_async_old_log_probs_follow_upstream_s_two_keys():
    base = _fully_async_8_8()
    recompute = _load(FULLY_ASYNC, [*base, "async_training.use_rollout_log_probs=False"])
    assert recompute.async_training.off_policy_correction == "none"
    one_step_window = _load(
        FULLY_ASYNC,
        [*base, "async_training.compute_prox_log_prob=True", "async_training.trigger_parameter_sync_step=1"],
    )
    assert one_step_window.async_training.off_policy_correction == "none"
    assert one_step_window.async_training.staleness_threshold == pytest.approx(0.1)  # N=1: upstream's s as it is
    explicit = _load(FULLY_ASYNC, [*base, "async_training.off_policy_correction=decoupled"])
    assert explicit.async_training.off_policy_correction == "decoupled"


def test_fully_async_refuses_what_upstream_does_not_take():
    base = _fully_async_8_8()
    with pytest.raises(ConfigError, match="data.gen_batch_size=4: the fully-async trainer takes 1 only"):
        _load(FULLY_ASYNC, [*base, "data.gen_batch_size=4"])
    with pytest.raises(ConfigError, match="actor_rollout_ref.actor.use_rollout_log_probs=False differs"):
        _load(FULLY_ASYNC, [*base, "actor_rollout_ref.actor.use_rollout_log_probs=False"])
    with pytest.raises(ConfigError, match=r"rollout.total_rollout_steps=100 is fewer prompts than one trainer step"):
        _load(FULLY_ASYNC, [*base, "rollout.total_rollout_steps=100"])


def test_one_step_off_is_one_batch_ahead_with_the_rollout_s_log_probs():
    (script,) = [s for s in SCRIPTS if s["script"].endswith("one_step_off_policy/shell/grpo_0.6b_gsm8k_fsdp2_2_6.sh")]
    cfg = _load(ONE_STEP_OFF, script["args"])
    assert cfg.async_training.staleness_threshold == 1 and cfg.async_training.trigger_parameter_sync_step == 1
    assert cfg.async_training.off_policy_correction == "none"
    assert cfg.algorithm.rollout_correction.bypass_mode is True  # old log-probs = the rollout's, as upstream
    assert cfg.actor_rollout_ref.rollout.calculate_log_probs is True
    assert cfg.actor_rollout_ref.rollout.free_cache_engine is False
    assert (cfg.rollout.nnodes, cfg.rollout.n_gpus_per_node, cfg.trainer.n_gpus_per_node) == (1, 2, 6)


def test_a_relative_config_path_is_the_entry_point_s_own_directory():
    cmd = parse_command_line(
        ["--config-path=config", "--config-name=fully_async_ppo_megatron_trainer.yaml"], **FULLY_ASYNC.command_line()
    )
    assert cmd.config_dir == Path("verl/experimental/fully_async_policy/config").resolve()
    assert cmd.config_name == "fully_async_ppo_megatron_trainer"
    default = parse_command_line([], **ONE_STEP_OFF.command_line())
    assert default.config_dir.name == "config" and default.config_dir.parent.name == "one_step_off_policy"
    assert default.config_name == "one_step_off_ppo_trainer"
    main_ppo = parse_command_line(["--config-path=config"])  # main_ppo's own rule is unchanged
    assert main_ppo.config_dir == Path("verl/trainer/config").resolve()
