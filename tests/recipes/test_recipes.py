"""Every recipe under `recipes/` trains through its own run script, on CPU, with real Ray workers.

A recipe is a config (`recipes/<name>/config/<name>_trainer.yaml`, a defaults list on top of
`ppo_trainer`), a run script and a README. The fast tests check the folders: the config composes
and validates, and the README documents every key the config sets. The slow test runs each
recipe's script for 2 steps at the smallest sizes that still form groups and checks that it exits
0, that the resolved config holds the recipe's settings (so the YAML really was applied) and that
the metrics only that algorithm produces were logged.

Cost: the runs share one Ray cluster (the `shared_ray_cluster` fixture; each script joins it through
RAY_ADDRESS instead of starting its own) and run a few at a time, with one worker process each
(the two-rank path is covered by tests/trainer/test_main_ppo_e2e.py).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow  # the slow tier (make test-all, CI): see docs/testing.md

ROOT = Path(__file__).resolve().parents[2]
RECIPES_DIR = ROOT / "recipes"

# recipe -> (settings its config must put in the resolved config, metrics only that algorithm logs)
RECIPES = {
    "drgrpo": (
        {
            "algorithm.adv_estimator": "grpo",
            "algorithm.norm_adv_by_std_in_grpo": False,
            "actor_rollout_ref.actor.loss_agg_mode": "seq-mean-token-sum-norm",
        },
        ("actor/pg_loss",),
    ),
    "gspo": (
        {
            "actor_rollout_ref.actor.policy_loss.loss_mode": "gspo",
            "actor_rollout_ref.actor.loss_agg_mode": "seq-mean-token-mean",
            "actor_rollout_ref.actor.clip_ratio_low": 0.0003,
            "actor_rollout_ref.actor.clip_ratio_high": 0.0004,
        },
        ("actor/pg_loss", "actor/pg_clipfrac"),
    ),
    "reinforce_plus_plus": (
        {"algorithm.adv_estimator": "reinforce_plus_plus", "actor_rollout_ref.actor.kl_loss_type": "mse"},
        ("actor/kl_loss",),
    ),
    "rloo": (
        {"algorithm.adv_estimator": "rloo", "algorithm.use_kl_in_reward": True},
        ("actor/reward_kl_penalty",),
    ),
    "remax": (
        {"algorithm.adv_estimator": "remax", "algorithm.use_kl_in_reward": True},
        ("timing_s/gen_max", "actor/reward_kl_penalty"),
    ),
    "ppo_with_critic": (
        {"algorithm.adv_estimator": "gae", "algorithm.lam": 0.95},
        ("critic/vf_loss", "critic/vf_explained_var", "critic/values/mean"),
    ),
}

# A small run with groups and one worker process. 8 prompts x 4 samples: with the bundled model (~29% correct) a prompt's 4 samples all score alike
# with probability ~0.26, so a step whose every group has zero advantage (skipped, no actor/pg_loss)
# has probability ~2e-5. With 4 prompts x 2 samples it was ~0.12 per step: the sampled tokens, not
# the recipe, decided whether the step's algorithm metrics existed.
TINY = [
    "data.train_batch_size=8",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=8",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32",
    "critic.ppo_micro_batch_size_per_gpu=32",
    "trainer.n_gpus_per_node=1",
    "trainer.total_training_steps=2",
    "trainer.val_before_train=False",
    "trainer.test_freq=-1",
    "trainer.save_freq=-1",
    "trainer.logger=[console,file]",
]
MAX_CONCURRENT_RUNS = 3


def _script(name: str) -> Path:
    scripts = sorted((RECIPES_DIR / name).glob("run_*arith_tiny_cpu.sh"))
    assert len(scripts) == 1, f"recipes/{name} should have exactly one run_*arith_tiny_cpu.sh, found {scripts}"
    return scripts[0]


def _script_cli_args(name: str) -> list[str]:
    """The main_ppo arguments a run script passes (its `--config-path` resolved), without "$@"."""
    text = _script(name).read_text()
    body = text.split("-m verl.trainer.main_ppo", 1)[1].split('"$@"', 1)[0]
    body = body.replace('"$HERE/config"', str(RECIPES_DIR / name / "config"))
    return shlex.split(body.replace("\\\n", " "))


def _leaf_keys(node, prefix: str = "") -> list[str]:
    if not isinstance(node, dict):
        return [prefix[:-1]]
    return [k for key, value in node.items() for k in _leaf_keys(value, f"{prefix}{key}.")]


def _select(cfg: dict, dotted: str):
    for part in dotted.split("."):
        cfg = cfg[part]
    return cfg


ALL_RECIPES = sorted(p.name for p in RECIPES_DIR.iterdir() if p.is_dir())


def test_every_recipe_folder_is_listed_here():
    assert set(ALL_RECIPES) == set(RECIPES) | {"dapo"}  # dapo runs in tests/trainer/test_main_ppo_e2e.py


@pytest.mark.parametrize("name", ALL_RECIPES)
def test_recipe_config_composes_on_ppo_trainer_and_validates(name):
    from verl.trainer.config import load_ppo_config, parse_cli_args

    config_file = RECIPES_DIR / name / "config" / f"{name}_trainer.yaml"
    raw = yaml.safe_load(config_file.read_text())
    assert raw["defaults"] == ["ppo_trainer", "_self_"]
    config_path, overrides = parse_cli_args(_script_cli_args(name))
    assert Path(config_path) == config_file
    cfg = load_ppo_config(overrides, config_path)  # validates: an unknown key or bad value raises
    from omegaconf import OmegaConf

    resolved = OmegaConf.to_container(cfg)
    for key in _leaf_keys({k: v for k, v in raw.items() if k != "defaults"}):
        assert _select(resolved, key) == _select(raw, key), key
    for key, value in RECIPES.get(name, ({}, ()))[0].items():
        assert _select(resolved, key) == value, key


@pytest.mark.parametrize("name", ALL_RECIPES)
def test_recipe_readme_names_every_key_its_config_sets(name):
    """Each key the config sets appears in the README in backticks, in full or as a dotted suffix
    (`clip_ratio_high` after a full `actor_rollout_ref.actor.clip_ratio_low`)."""
    raw = yaml.safe_load((RECIPES_DIR / name / "config" / f"{name}_trainer.yaml").read_text())
    readme = (RECIPES_DIR / name / "README.md").read_text()
    spans = {span.split("=", 1)[0].strip() for span in re.findall(r"`([^`]+)`", readme)}
    keys = _leaf_keys({k: v for k, v in raw.items() if k not in ("defaults", "trainer")}) + [
        f"trainer.{k}" for k in raw.get("trainer", {}) if k != "experiment_name"
    ]
    missing = [k for k in keys if not any(k == s or k.endswith("." + s) for s in spans)]
    assert not missing, f"recipes/{name}/README.md does not mention {missing}"
    assert _script(name).name in readme
    assert "--config-name" in readme  # the GPU command uses the same config


@pytest.mark.parametrize("name", ALL_RECIPES)
def test_recipe_readme_gpu_command_is_a_valid_config(name, monkeypatch):
    """The README's `--config-name` command (paths as written, relative to the repository root) validates."""
    from verl.trainer.config import load_ppo_config, parse_cli_args

    monkeypatch.chdir(ROOT)
    readme = (RECIPES_DIR / name / "README.md").read_text()
    (command,) = [b for b in re.findall(r"```bash\n(.*?)```", readme, flags=re.S) if "--config-name" in b]
    args = shlex.split(command.replace("\\\n", " ").replace("$HOME", "/data"))
    config_path, overrides = parse_cli_args(args[args.index("verl.trainer.main_ppo") + 1 :])
    assert Path(config_path).resolve() == RECIPES_DIR / name / "config" / f"{name}_trainer.yaml"
    cfg = load_ppo_config(overrides, config_path)
    assert cfg.trainer.n_gpus_per_node == 8 and cfg.actor_rollout_ref.rollout.name == "vllm"


# ----------------------------------------------------------------------------------- the runs


@pytest.fixture(scope="module")
def recipe_runs(shared_ray_cluster, tmp_path_factory):
    """Run every recipe script for 2 steps on one shared Ray cluster; {name: (returncode, log, run_dir)}."""
    from verl.models import bundled_model_path
    from verl.utils.dataset.arith import ensure_arith_data

    root = tmp_path_factory.mktemp("recipes")
    train, test = ensure_arith_data(str(root / "data"))
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHON=sys.executable, RAY_DEDUP_LOGS="0")
    env = shared_ray_cluster.env_for(env)
    env.pop("VERL_FILE_LOGGER_PATH", None)  # each run's metrics go to its own run_dir/metrics.jsonl

    def run(name: str):
        out = root / name
        cmd = [
            "bash",
            str(_script(name)),
            f"actor_rollout_ref.model.path={bundled_model_path()}",
            f"data.train_files={train}",
            f"data.val_files={test}",
            f"trainer.default_local_dir={out / 'ckpt'}",
            f"trainer.run_dir={out / 'run'}",
            *TINY,
        ]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        return proc.returncode, f"{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-6000:]}", out / "run"

    with ThreadPoolExecutor(MAX_CONCURRENT_RUNS) as pool:
        return dict(zip(RECIPES, pool.map(run, RECIPES), strict=True))


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_script_trains_two_steps_and_logs_its_algorithm_metrics(name, recipe_runs):
    returncode, log, run_dir = recipe_runs[name]
    assert returncode == 0, f"recipes/{name} exited {returncode}\n{log}"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in records] == [1, 2]
    settings, metrics = RECIPES[name]
    last = records[-1]["data"]
    for key in (*metrics, "critic/score/mean", "response_length/mean", "actor/grad_norm"):
        assert key in last, f"{key} missing from the step metrics of recipes/{name}: {sorted(last)}"
    assert 0.0 <= last["critic/score/mean"] <= 1.0
    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    for key, value in settings.items():
        assert _select(resolved, key) == value, f"recipes/{name}: {key}"
