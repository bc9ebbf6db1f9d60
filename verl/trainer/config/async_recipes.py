"""Upstream's asynchronous entry points, in verl's keys.

Upstream runs asynchronous training from two modules of its own, each with its config:
`python -m verl.experimental.one_step_off_policy.main_ppo` (`one_step_off_ppo[_megatron]_trainer.yaml`)
and `python -m verl.experimental.fully_async_policy.fully_async_main`
(`fully_async_ppo[_megatron]_trainer.yaml`). Here both run `main_ppo`'s trainer with
`async_training.*` (docs/async.md); these functions turn a composed config of theirs into that, in
place, before the config is checked. Each consumes the keys only upstream's config has, so the result
is a plain verl config, and refuses, in one message, what has no equivalent here.

One-step-off (`translate_one_step_off`): the YAML already says it in verl's keys
(`async_training.staleness_threshold=1`, `off_policy_correction=none`: the old log-probs are the
rollout's with upstream's `algorithm.rollout_correction.bypass_mode=True`, the trainer's recompute
without); only `actor_rollout_ref.hybrid_engine=False`, which upstream's scripts set for the separate
rollout pool, is taken as what it means here (the trainer pool keeps its engine, for validation).

Fully asynchronous (`translate_fully_async`), with s = `staleness_threshold`, N =
`trigger_parameter_sync_step` and R = `require_batches`:
- a trainer step trains `ppo_mini_batch_size x R` prompts (upstream's `required_samples`; upstream
  ignores `data.train_batch_size`, which its scripts set to 0): that is `data.train_batch_size` here;
- the rollout pool generates up to (1 + s) x N steps' prompts per weight version (upstream's
  `max_required_samples`): `staleness_threshold = s x N + N - 1` here, which submits exactly that far
  ahead of each sync (docs/async.md); N stays `trigger_parameter_sync_step`;
- old log-probs: the rollout's (`use_rollout_log_probs=True`) is `off_policy_correction=tis`; the
  trainer's recompute (`use_rollout_log_probs=False`, or `compute_prox_log_prob=True` with N=1, whose
  window is one step) is `none`, with `algorithm.rollout_correction` applied as upstream applies it.
  `compute_prox_log_prob=True` with N > 1 recomputes them with the weights of the sync window's
  first step, which are not kept here: refused;
- `rollout.total_rollout_steps` prompts in all: `trainer.total_training_steps` = that // the step's
  prompts; epochs: the smaller of `trainer.total_epochs` and `rollout.total_epochs`;
- `rollout.test_freq` and `trainer.save_freq` count weight versions upstream: x N trainer steps here;
- `data.gen_batch_size` must be 1 (upstream asserts it; here prompts stream to the pool in chunks);
- speed only: `async_training.checkpoint_engine.*` (the weights travel by verl's bucketed broadcast,
  `actor_rollout_ref.rollout.update_weights_bucket_megabytes`); `use_trainer_do_validate`: validation
  always runs on the trainer pool with the trainer's current weights (upstream's `True`); the top-level
  `rollout.n` is read by neither (the samples per prompt are `actor_rollout_ref.rollout.n`).
"""

from __future__ import annotations

import logging

from omegaconf import DictConfig, OmegaConf, open_dict

from verl.trainer.config.errors import ConfigError

logger = logging.getLogger(__name__)

# keys only upstream's fully-async config has, consumed by translate_fully_async
_FULLY_ASYNC_ONLY = {
    "async_training": (
        "require_batches",
        "use_rollout_log_probs",
        "compute_prox_log_prob",
        "use_trainer_do_validate",
        "checkpoint_engine",
    ),
    "rollout": ("n", "total_rollout_steps", "total_epochs", "test_freq"),
    "actor_rollout_ref": ("checkpoint_engine",),
    "actor_rollout_ref.actor": ("use_rollout_log_probs",),
}


def _drop(section: DictConfig, keys) -> None:
    with open_dict(section):
        for key in keys:
            section.pop(key, None)


def _colocated_trainer(cfg: DictConfig) -> None:
    """Upstream's async scripts set `hybrid_engine=False` (actor and rollout in separate pools); here the
    rollout pool is `rollout.*` and the trainer pool keeps an engine for validation, which is hybrid."""
    with open_dict(cfg.actor_rollout_ref):
        cfg.actor_rollout_ref.hybrid_engine = True


def translate_one_step_off(cfg: DictConfig) -> None:
    """A composed `one_step_off_ppo[_megatron]_trainer` config as verl's asynchronous training (in place)."""
    _colocated_trainer(cfg)


def translate_fully_async(cfg: DictConfig) -> None:
    """A composed `fully_async_ppo[_megatron]_trainer` config as verl's asynchronous training (in place);
    see the module docstring for each key. Raises ConfigError naming every value with no equivalent."""
    at, pool, arc, trainer = cfg.async_training, cfg.rollout, cfg.actor_rollout_ref, cfg.trainer
    errors: list[str] = []
    s, n_sync, require = at.staleness_threshold, at.trigger_parameter_sync_step, at.require_batches
    if s is None or s < 0:
        errors.append(f"async_training.staleness_threshold={s} must be at least 0")
    if n_sync is None or n_sync < 1:
        errors.append(f"async_training.trigger_parameter_sync_step={n_sync} must be at least 1")
    if require is None or require < 1:
        errors.append(f"async_training.require_batches={require} must be at least 1")
    if cfg.data.gen_batch_size != 1:
        errors.append(
            f"data.gen_batch_size={cfg.data.gen_batch_size}: the fully-async trainer takes 1 only (one prompt per "
            "generation request, as upstream asserts); remove the override"
        )
    use_rollout = bool(at.use_rollout_log_probs)
    actor_use_rollout = arc.actor.get("use_rollout_log_probs", use_rollout)
    if bool(actor_use_rollout) != use_rollout:
        errors.append(
            f"actor_rollout_ref.actor.use_rollout_log_probs={actor_use_rollout} differs from "
            f"async_training.use_rollout_log_probs={use_rollout}: the trainer and the actor would disagree on the "
            "old log-probs; set only async_training.use_rollout_log_probs (the actor's follows it)"
        )
    prox = bool(at.compute_prox_log_prob)
    if prox and n_sync is not None and n_sync > 1:
        errors.append(
            f"async_training.compute_prox_log_prob=True with trigger_parameter_sync_step={n_sync}: upstream recomputes "
            "the old log-probs with the weights of each sync window's first step, which are not kept here; use "
            "trigger_parameter_sync_step=1 (the window is one step, the recompute is the trainer's weights), or "
            "compute_prox_log_prob=False (the rollout's log-probs), or async_training.off_policy_correction=decoupled "
            "(the trainer's current weights as the proximal policy, docs/async.md)"
        )
    total_rollout = pool.get("total_rollout_steps")
    mini = arc.actor.ppo_mini_batch_size
    required = mini * require if require and require >= 1 else None
    if total_rollout is not None and required and total_rollout < required:
        errors.append(
            f"rollout.total_rollout_steps={total_rollout} is fewer prompts than one trainer step takes "
            f"(ppo_mini_batch_size {mini} x require_batches {require} = {required}); raise it"
        )
    if errors:
        raise ConfigError("\n".join(errors))

    correction = at.off_policy_correction or ("tis" if use_rollout and not prox else "none")
    ahead = round(s * n_sync + n_sync - 1, 9)
    with open_dict(cfg):
        if cfg.data.train_batch_size not in (0, required):
            logger.warning(
                "data.train_batch_size=%s is not read by the fully-async trainer (upstream's neither): a step trains "
                "ppo_mini_batch_size x require_batches = %s prompts",
                cfg.data.train_batch_size,
                required,
            )
        cfg.data.train_batch_size = required
        cfg.data.gen_batch_size = required
        at.staleness_threshold = float(ahead)
        at.off_policy_correction = correction
        trainer.total_epochs = min(trainer.total_epochs, pool.total_epochs)
        if total_rollout is not None:
            trainer.total_training_steps = total_rollout // required
        test_freq = pool.test_freq
        trainer.test_freq = test_freq * n_sync if test_freq and test_freq > 0 else -1
        if trainer.save_freq > 0:
            trainer.save_freq = trainer.save_freq * n_sync
        for section, keys in _FULLY_ASYNC_ONLY.items():
            _drop(OmegaConf.select(cfg, section), keys)
    _colocated_trainer(cfg)
    logger.warning(
        "fully-async config as verl's asynchronous training: %s prompts per step (ppo_mini_batch_size %s x "
        "require_batches %s), staleness_threshold %s -> %s batches ahead with a weight sync every %s steps, "
        "off_policy_correction=%s, total_training_steps=%s, test_freq=%s (docs/async.md)",
        required,
        mini,
        require,
        s,
        ahead,
        n_sync,
        correction,
        trainer.total_training_steps,
        trainer.test_freq,
    )


class EntryPoint:
    """An entry point that runs main_ppo's trainer from its own config directory (`main_ppo.main(entry=...)`):
    `module_file` is its module (a relative `--config-path` is read against its directory, as Hydra does for
    `@hydra.main`), `config_name` its default config in `<its directory>/config`, `translate` the function
    that rewrites that config in this trainer's keys."""

    def __init__(self, module_file: str, config_name: str, translate):
        from pathlib import Path

        self.directory = Path(module_file).resolve().parent
        self.config_name = config_name
        self.translate = translate

    def command_line(self) -> dict:
        return {"entry_dir": self.directory, "default_dir": self.directory / "config", "default_name": self.config_name}
