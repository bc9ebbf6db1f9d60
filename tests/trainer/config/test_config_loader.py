"""Loading the config: upstream's defaults, the demo, overrides (Hydra grammar), user configs, saving."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

import verl
from verl.trainer.config import (
    CONFIG_DIR,
    ConfigError,
    load_ppo_config,
    need_critic,
    need_reference_policy,
    parse_cli_args,
    parse_command_line,
    ray_init_kwargs,
    save_resolved_config,
    validate_ppo_config,
    world_size,
)


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("VERL_CACHE_DIR", str(tmp_path / "cache"))


def test_defaults_are_upstreams():
    """ppo_trainer holds upstream's defaults: PPO with GAE and a critic, one sample per prompt, no step
    limit, lr 1e-6, no default micro-batch (a run must choose one) and no default rollout engine."""
    cfg = load_ppo_config(validate=False)
    assert cfg.algorithm.adv_estimator == "gae"
    assert cfg.actor_rollout_ref.rollout.n == 1
    assert cfg.trainer.total_training_steps is None and cfg.trainer.test_freq == -1
    assert cfg.actor_rollout_ref.actor.optim.lr == pytest.approx(1e-6)
    assert cfg.actor_rollout_ref.actor.ppo_mini_batch_size == 256 and cfg.data.train_batch_size == 1024
    assert cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu is None
    assert cfg.actor_rollout_ref.model.use_remove_padding is True
    assert cfg.actor_rollout_ref.model.enable_gradient_checkpointing is True
    assert cfg.actor_rollout_ref.actor.use_torch_compile is True
    assert cfg.actor_rollout_ref.rollout.mode == "async" and cfg.data.return_raw_chat is True
    assert cfg.trainer.device == "cuda" and cfg.trainer.n_gpus_per_node == 8
    assert OmegaConf.is_missing(cfg.actor_rollout_ref.rollout, "name")
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.rollout.name must be set .*hf, vllm, sglang"):
        load_ppo_config()


def test_megatron_defaults_are_upstreams():
    cfg = load_ppo_config(["actor_rollout_ref.rollout.name=hf"], config_name="ppo_megatron_trainer", validate=False)
    assert cfg.actor_rollout_ref.actor.strategy == cfg.critic.strategy == "megatron"
    assert cfg.actor_rollout_ref.actor.megatron.dtype == "bfloat16"
    assert cfg.actor_rollout_ref.actor.optim.optimizer == "adam"
    assert "fsdp_config" not in cfg.actor_rollout_ref.actor  # upstream's megatron composition has none


def test_demo_config_describes_the_embedded_grpo_task(tmp_path):
    cfg = load_ppo_config(config_name="arith_demo")
    assert cfg.algorithm.adv_estimator == "grpo"
    assert cfg.actor_rollout_ref.rollout.name == "hf"
    assert cfg.actor_rollout_ref.rollout.n == 8
    assert cfg.data.train_batch_size == 32
    assert cfg.data.max_prompt_length == 32 and cfg.data.max_response_length == 8
    assert cfg.actor_rollout_ref.actor.optim.lr == pytest.approx(1e-4)
    assert cfg.actor_rollout_ref.actor.use_kl_loss is False
    assert cfg.actor_rollout_ref.actor.entropy_coeff == 0
    assert cfg.actor_rollout_ref.actor.grad_clip == 1.0
    assert cfg.trainer.n_gpus_per_node == 2 and cfg.trainer.nnodes == 1
    assert cfg.trainer.device == "auto"
    assert list(cfg.trainer.logger) == ["console", "file"]
    val = cfg.actor_rollout_ref.rollout.val_kwargs
    assert val.do_sample is False and val.temperature == 0 and val.n == 1
    # Resolvers: the bundled model inside the package, generated data under $VERL_CACHE_DIR.
    assert Path(cfg.actor_rollout_ref.model.path) == Path(verl.__file__).parent / "assets" / "arith-tiny"
    assert cfg.data.train_files == str((tmp_path / "cache" / "data/arith/train.parquet").resolve())
    assert cfg.data.val_files == str((tmp_path / "cache" / "data/arith/test.parquet").resolve())
    # Interpolations are resolved, so the config pickles to workers that never import this package.
    assert "${" not in OmegaConf.to_yaml(cfg)
    assert cfg.actor_rollout_ref.rollout.prompt_length == 32
    assert cfg.critic.model.path == cfg.actor_rollout_ref.model.path


def test_cache_dir_defaults_to_home_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("VERL_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_ppo_config(config_name="arith_demo")
    assert cfg.data.train_files == str(tmp_path / ".cache" / "verl" / "data/arith/train.parquet")


def test_demo_batch_arithmetic_holds_by_hand():
    cfg = load_ppo_config(config_name="arith_demo")
    a = cfg.actor_rollout_ref
    ranks = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    assert world_size(cfg) == ranks == 2
    assert (cfg.data.train_batch_size * a.rollout.n) % ranks == 0  # 256 sequences over 2 ranks
    per_rank_mini = a.actor.ppo_mini_batch_size * a.rollout.n // ranks  # 32 * 8 / 2 = 128
    assert per_rank_mini == 128 and per_rank_mini % a.actor.ppo_micro_batch_size_per_gpu == 0


def test_loaded_config_is_struct_like_hydra():
    cfg = load_ppo_config(config_name="arith_demo")
    with pytest.raises(Exception, match="not_a_key"):
        _ = cfg.trainer.not_a_key


def test_overrides_use_hydra_value_grammar_and_interpolations_follow():
    cfg = load_ppo_config(
        [
            "data.train_batch_size=64",
            "data.max_prompt_length=48",
            "trainer.logger=[console,file,mlflow]",
            "actor_rollout_ref.actor.optim.lr=3e-5",
            "trainer.total_training_steps=null",
            "trainer.experiment_name='my run'",
        ],
        config_name="arith_demo",
    )
    assert cfg.data.train_batch_size == 64
    assert cfg.data.gen_batch_size is None  # upstream's default: the dataloader draws train_batch_size prompts
    assert cfg.actor_rollout_ref.rollout.prompt_length == 48  # ${data.max_prompt_length}
    assert list(cfg.trainer.logger) == ["console", "file", "mlflow"]
    assert cfg.actor_rollout_ref.actor.optim.lr == pytest.approx(3e-5)
    assert cfg.trainer.total_training_steps is None
    assert cfg.trainer.run_dir == "outputs/verl_arith/my run"


def test_plus_adds_a_key_where_the_schema_allows_extra_keys():
    cfg = load_ppo_config(
        ["+ray_kwargs.ray_init.include_dashboard=false", "ray_init.num_cpus=4"], config_name="arith_demo"
    )
    assert ray_init_kwargs(cfg) == {"include_dashboard": False, "num_cpus": 4}


def test_misspelled_override_names_the_closest_key():
    with pytest.raises(ConfigError) as e:
        load_ppo_config(["data.train_batch_sze=64"])
    msg = str(e.value)
    assert "data.train_batch_sze" in msg and "Did you mean data.train_batch_size?" in msg
    assert "+data.train_batch_sze" in msg  # how to add a new key on purpose


def test_key_in_the_wrong_section_suggests_where_it_lives():
    with pytest.raises(ConfigError, match=r"Did you mean actor_rollout_ref\.actor\.optim\.lr\?"):
        load_ppo_config(["actor_rollout_ref.actor.lr=1e-3"])


def test_truncated_key_suggests_the_full_name():
    with pytest.raises(ConfigError, match=r"Did you mean trainer\.n_gpus_per_node\?"):
        load_ppo_config(["trainer.n_gpus=4"])


def test_override_below_a_value_says_it_is_not_a_section():
    with pytest.raises(ConfigError, match="data.train_batch_size is a value, not a section"):
        load_ppo_config(["data.train_batch_size.foo=1"])


def test_adding_an_existing_key_with_plus_is_an_error():
    with pytest.raises(ConfigError, match="already exists"):
        load_ppo_config(["+data.train_batch_size=64"])


def test_unparseable_override_is_a_config_error():
    with pytest.raises(ConfigError, match="cannot parse override"):
        load_ppo_config(["data.train_batch_size=[1,"])


def test_deleted_key_is_reported_missing():
    with pytest.raises(ConfigError, match="data.seed is missing"):
        load_ppo_config(["~data.seed"])


def test_recipe_file_with_defaults_list_starts_from_a_bundled_config(tmp_path):
    recipe = tmp_path / "my_recipe.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "hydra": {"searchpath": ["pkg://verl.trainer.config"]},
                "defaults": ["arith_demo", "_self_"],
                "algorithm": {"adv_estimator": "rloo"},
                "trainer": {"experiment_name": "rloo_run"},
            }
        )
    )
    cfg = load_ppo_config(["trainer.total_training_steps=5"], config_path=recipe)
    assert cfg.algorithm.adv_estimator == "rloo"
    assert cfg.trainer.total_training_steps == 5
    assert cfg.data.train_batch_size == 32  # from arith_demo
    assert cfg.trainer.run_dir == "outputs/verl_arith/rloo_run"  # interpolation sees the recipe's value
    assert "hydra" not in cfg


def test_user_config_starting_from_ppo_trainer_composes_anywhere(tmp_path, monkeypatch):
    """Upstream's example configs say `defaults: [ppo_trainer, _self_]` with a search path relative to
    upstream's checkout (`file://verl/trainer/config`); verl's config directory is always searched."""
    (tmp_path / "mine.yaml").write_text(
        "hydra:\n  searchpath:\n    - file://verl/trainer/config\n"
        "defaults:\n  - ppo_trainer\n  - _self_\n"
        "actor_rollout_ref:\n  rollout:\n    name: hf\n    n: 4\n"
    )
    monkeypatch.chdir(tmp_path)
    cfg = load_ppo_config(config_path=str(tmp_path), config_name="mine", validate=False)
    assert cfg.actor_rollout_ref.rollout.name == "hf" and cfg.actor_rollout_ref.rollout.n == 4
    assert cfg.actor_rollout_ref.actor.rollout_n == 4  # upstream's interpolations follow the user's value
    assert cfg.algorithm.adv_estimator == "gae"


def test_config_group_entries_and_overrides_compose_as_in_hydra(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "defaults:\n  - ppo_trainer\n  - override actor@actor_rollout_ref.actor: megatron_actor\n  - _self_\n"
    )
    cfg = load_ppo_config(config_path=recipe, validate=False)
    assert cfg.actor_rollout_ref.actor.strategy == "megatron" and "megatron" in cfg.actor_rollout_ref.actor
    cfg = load_ppo_config(["critic=megatron_critic"], validate=False)  # Hydra's spelling of that group
    assert cfg.critic.strategy == "megatron" and cfg.critic.optim.lr_decay_style == "constant"


def test_missing_config_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_ppo_config(config_path=tmp_path / "nope.yaml")


def test_parse_cli_args_understands_hydra_config_options(tmp_path):
    path, overrides = parse_cli_args([f"--config-path={tmp_path}", "--config-name", "dapo", "data.train_batch_size=8"])
    assert path == str(tmp_path / "dapo.yaml") and overrides == ["data.train_batch_size=8"]
    assert parse_cli_args(["a.b=1"]) == (None, ["a.b=1"])
    with pytest.raises(ConfigError, match="unknown option"):
        parse_cli_args(["--frobnicate"])
    cmd = parse_command_line(["--config-name=ppo_megatron_trainer.yaml", "--cfg", "job", "--resolve", "x=1"])
    assert (cmd.config_dir, cmd.config_name, cmd.cfg, cmd.resolve) == (CONFIG_DIR, "ppo_megatron_trainer", "job", True)
    with pytest.raises(ConfigError, match="--cfg hydra"):
        parse_command_line(["--cfg", "hydra"])


def test_relative_config_path_is_read_as_hydra_reads_it_for_main_ppo(tmp_path, monkeypatch):
    """Hydra reads a relative --config-path against main_ppo.py's directory (verl/trainer), so upstream's
    `--config-path=config` and `./config` are verl's own configs, from any working directory; a path that
    exists only under the working directory is taken from there."""
    monkeypatch.chdir(tmp_path)
    assert parse_command_line(["--config-path=config"]).config_dir == CONFIG_DIR
    assert parse_command_line(["--config-path=./config"]).config_dir == CONFIG_DIR
    (tmp_path / "mine").mkdir()
    assert parse_command_line(["--config-path=mine"]).config_dir == tmp_path / "mine"
    with pytest.raises(ConfigError, match="no such directory"):
        parse_command_line(["--config-path=nowhere"])


def test_hydra_compose_reads_the_yaml_and_the_result_validates():
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg = compose(config_name="arith_demo", overrides=["data.train_batch_size=64", "algorithm.adv_estimator=rloo"])
    assert cfg.data.train_batch_size == 64 and cfg.algorithm.adv_estimator == "rloo"
    assert cfg.actor_rollout_ref.model.path.endswith("arith-tiny")  # the demo's resolver works under Hydra
    validate_ppo_config(cfg)
    assert OmegaConf.is_interpolation(cfg.actor_rollout_ref.rollout, "prompt_length")  # validation did not modify it


def test_save_resolved_config_round_trips(tmp_path):
    cfg = load_ppo_config(["data.train_batch_size=16"], config_name="arith_demo")
    path = save_resolved_config(cfg, tmp_path / "run")
    assert path == tmp_path / "run" / "config.yaml"
    text = path.read_text()
    assert "${" not in text
    assert yaml.safe_load(text) == OmegaConf.to_container(cfg, resolve=True)


def test_save_resolved_config_resolves_a_hydra_config(tmp_path):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg = compose(config_name="arith_demo")
    saved = yaml.safe_load(save_resolved_config(cfg, tmp_path).read_text())
    assert saved["actor_rollout_ref"]["rollout"]["prompt_length"] == saved["data"]["max_prompt_length"] and saved[
        "actor_rollout_ref"
    ]["model"]["path"].endswith("arith-tiny")


def test_role_helpers_follow_upstream_rules():
    def demo(*overrides):
        return load_ppo_config(list(overrides), config_name="arith_demo")

    grpo = demo()
    assert not need_critic(grpo) and not need_reference_policy(grpo)
    assert need_critic(demo("algorithm.adv_estimator=gae"))
    assert need_critic(demo("critic.enable=true"))
    assert need_reference_policy(demo("actor_rollout_ref.actor.use_kl_loss=true"))
    assert need_reference_policy(demo("algorithm.use_kl_in_reward=true"))
    assert need_critic(load_ppo_config(validate=False))  # upstream's default: GAE


def test_override_can_fill_a_mandatory_value():
    from verl.trainer.config import apply_overrides

    cfg = OmegaConf.create({"rollout": {"name": "???", "n": "${other}"}})
    apply_overrides(cfg, ["rollout.name=vllm", "rollout.n=4"])  # neither value is resolved to check existence
    assert cfg.rollout.name == "vllm" and cfg.rollout.n == 4


def test_data_value_takes_the_data_yamls_default_for_a_key_a_partial_section_leaves_out():
    from verl.trainer.config.loader import data_value

    data_yaml = yaml.safe_load((Path(verl.__file__).parent / "trainer/config/data/legacy_data.yaml").read_text())
    composed = load_ppo_config(["data.reward_fn_key=source", "data.max_response_length=7"], config_name="arith_demo")
    assert data_value(composed.data, "reward_fn_key") == "source"
    assert data_value(composed.data, "max_response_length") == 7
    partial = {"sampler": None, "max_response_length": 3}
    assert data_value(partial, "max_response_length") == 3
    assert data_value(partial, "reward_fn_key") == data_yaml["reward_fn_key"] == "data_source"
    assert data_value(partial, "dataloader_num_workers") == data_yaml["dataloader_num_workers"] == 8
    assert data_value(partial, "sampler.class_path") is None  # a null section on the way: the YAML's value
    assert data_value(None, "max_response_length") == data_yaml["max_response_length"] == 512
