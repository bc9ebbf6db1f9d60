"""Keys a recipe driver's own config declares (verl.trainer.config.driver_keys).

verl-recipe's SPPO composes `ppo_trainer` with `config/sppo_trainer.yaml`, which adds `algorithm.sppo_eta`
and sets `algorithm.adv_estimator: null` (its trainer computes its own advantages), then calls upstream's
`verl.utils.config.validate_config` from its TaskRunner. Those settings are the recipe's and accepted;
the same keys given any other way, and typos, stay errors. A driver is written here the same way (its
own file beside a `config/` folder) and run with runpy, so `validate_config` sees it as its caller."""

from __future__ import annotations

import runpy
from dataclasses import dataclass

import pytest
from omegaconf import OmegaConf

from verl.trainer.config import ConfigError, load_ppo_config
from verl.trainer.config.driver_keys import driver_keys_near
from verl.workers.config import FSDPActorConfig

RECIPE_YAML = """\
hydra:
  searchpath:
    - file://verl/trainer/config
defaults:
  - ppo_trainer
  - _self_
actor_rollout_ref:
  actor:
    optim:
      lr_warmup_steps: 15
algorithm:
  adv_estimator: null
  my_eta: 1.0
  my_section:
    beta: 0.5
"""

DRIVER = """\
from verl.utils.config import validate_config


def run(config):
    validate_config(config, use_reference_policy=False, use_critic=False)
"""


def _config(*overrides: str, recipe_keys: bool = True):
    cfg = load_ppo_config(["trainer.device=cpu", *overrides], config_name="arith_demo")
    if not recipe_keys:
        return cfg
    extra = OmegaConf.create({"algorithm": {"adv_estimator": None, "my_eta": 1.0, "my_section": {"beta": 0.5}}})
    OmegaConf.set_struct(cfg, False)
    return OmegaConf.merge(cfg, extra)


@pytest.fixture
def driver(tmp_path):
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "my_trainer.yaml").write_text(RECIPE_YAML)
    path = tmp_path / "main_recipe.py"
    path.write_text(DRIVER)
    return runpy.run_path(str(path))["run"]


def test_the_driver_files_keys_are_read_with_their_values(tmp_path, driver):
    keys = driver_keys_near(str(tmp_path / "main_recipe.py"))
    assert keys["algorithm.my_eta"] == 1.0 and keys["algorithm.my_section.beta"] == 0.5
    assert keys["algorithm.adv_estimator"] is None
    assert "defaults" not in keys and "hydra" not in keys
    assert keys.source["algorithm.my_eta"].endswith("my_trainer.yaml")
    assert not driver_keys_near(str(tmp_path / "elsewhere" / "main.py"))  # no config/ folder: nothing declared


def test_a_recipe_driver_s_own_keys_and_null_estimator_are_accepted(driver):
    driver(_config())


def test_the_same_keys_without_the_driver_s_files_are_refused():
    from verl.utils.config import validate_config

    with pytest.raises(ConfigError) as err:
        validate_config(_config())  # called from this test file: no config/ folder beside it
    text = str(err.value)
    assert "unknown config key 'algorithm.my_eta'" in text and "algorithm.my_section" in text
    assert "algorithm.adv_estimator=None" in text


def test_a_typo_next_to_the_recipe_s_keys_is_still_refused(driver):
    cfg = _config()
    cfg.algorithm.my_etaa = 2.0
    with pytest.raises(ConfigError, match="algorithm.my_etaa"):
        driver(cfg)


@dataclass
class RecipeActorConfig(FSDPActorConfig):
    """A recipe's actor class (as SPPO's `SPPOActorConfig`): its own field has no `doc` metadata."""

    recipe_eta: float = 1.0


def test_a_section_class_of_the_recipe_s_own_is_checked_with_its_fields():
    from verl.utils.config import validate_config

    target = f"{__name__}.RecipeActorConfig"
    own = (f"actor_rollout_ref.actor._target_={target}",)
    validate_config(_config(*own, "+actor_rollout_ref.actor.recipe_eta=2.0", recipe_keys=False))
    with pytest.raises(ConfigError, match="recipe_eta"):
        validate_config(_config(*own, "+actor_rollout_ref.actor.recipe_eta=fast", recipe_keys=False))


TRAINER_DRIVER = """\
from verl.trainer.ppo.ray_trainer import RayPPOTrainer
from verl.trainer.ppo.utils import Role


def build(config, tokenizer):
    return RayPPOTrainer(config=config, tokenizer=tokenizer, role_worker_mapping={Role.ActorRollout: object},
                         resource_pool_manager=None)
"""


def test_a_driver_that_builds_the_trainer_from_its_own_config_file_keeps_that_files_keys(tmp_path):
    """Upstream's examples/split_placement: its ppo_trainer_split.yaml sets keys its release no longer reads
    (`reward_model.model.fsdp_config.min_num_params`); upstream accepts them, so does the trainer's check when
    the file sits in the driver's config/ folder. The same key from elsewhere, and a typo, stay errors."""
    from verl.utils.tokenizer import hf_tokenizer

    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "ppo_trainer_split.yaml").write_text(
        "defaults:\n  - ppo_trainer\n  - _self_\nreward_model:\n  model:\n    fsdp_config:\n      min_num_params: 0\n"
    )
    (tmp_path / "main_split.py").write_text(TRAINER_DRIVER)
    build = runpy.run_path(str(tmp_path / "main_split.py"))["build"]
    cfg = _config(recipe_keys=False)
    OmegaConf.set_struct(cfg, False)
    cfg = OmegaConf.merge(cfg, {"reward_model": {"model": {"fsdp_config": {"min_num_params": 0}}}})
    tokenizer = hf_tokenizer(cfg.actor_rollout_ref.model.path)
    build(cfg, tokenizer)  # accepted: the driver's own file declares it
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.trainer.ppo.utils import Role

    with pytest.raises(ConfigError, match="reward_model.model.fsdp_config.min_num_params"):
        RayPPOTrainer(
            config=cfg, tokenizer=tokenizer, role_worker_mapping={Role.ActorRollout: object}, resource_pool_manager=None
        )
    cfg.reward_model.model.fsdp_config.min_num_param = 1
    with pytest.raises(ConfigError, match="min_num_param'"):
        build(cfg, tokenizer)
