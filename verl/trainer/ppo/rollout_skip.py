"""`rollout.skip_rollout`: generate once, then replay that rollout instead of generating.

Upstream's `RolloutSkip` (verl/utils/rollout_skip.py) patches the rollout worker group's
`generate_sequences`: the first call of a run whose dump file is missing generates and writes the
file; every later call, in this run and in the next ones, loads the file instead of generating.
One file, not one per step: every training step after the first trains on the same rollout, a
tool for debugging and timing the phases after generation. Its name and place are upstream's:
`<rollout.skip_dump_dir>/{experiment}_{project}_GBS{gbs}__N{n}`, where gbs is `data.gen_batch_size`
(else `data.train_batch_size`), n is `rollout.n`, and experiment and project are read from
`data.experiment_name` / `data.project_name`, keys upstream's config does not have, so both are
empty (`__GBS32__N8`); a run with another batch size or n gets a file of its own.

Design decisions (where this differs from upstream, and why):
- What is dumped is the rollout generator's output merged with its prompts' rows (responses,
  masks, the prompts' data_source / ground truth / uid, ReMax's `reward_baselines`), before
  scoring, not the worker group's raw output: replayed at a later step, upstream's raw output meets
  that step's prompt rows, so the rewards compare step 1's responses with step k's ground truth
  (and here the merge refuses rows whose prompt columns differ). Replaying the whole rows keeps
  each sample scored against its own prompt; the dataloader still advances one batch per step, so
  step counting, epochs and checkpoints behave as in a generating run.
- The file is written with `torch.save` of plain tensors and containers and read with
  `weights_only=True` (verl.utils.checkpoint.safe_load), not pickled: `/tmp/rollout_dump` is a
  shared directory, and unpickling a file found there would run whatever it says. A file that does
  not load (an upstream pickle, a truncated write) is reported and regenerated, as upstream does.
- Only the training rollouts replay; validation generates (upstream's patch also caught the
  periodic validation of its non-agent-loop path, which then scored the training dump).
- Refused (by the config check) with DAPO's dynamic sampling, which would draw the same groups
  again and again, and with asynchronous training, whose rollouts come from their own pool.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from verl.protocol import DataProto
from verl.utils.logging_utils import get_logger
from verl.utils.rollout_skip import RolloutDump, dump_file_name

__all__ = ["ReplayingGenerator", "RolloutDump", "StepReplayingGenerator", "dump_path", "step_dump_root"]

logger = get_logger(__name__, "INFO")


def dump_path(config) -> Path:
    """Upstream's file for this config's rollouts (see the module docstring)."""
    data, rollout = config.data, config.actor_rollout_ref.rollout
    gbs = data.get("gen_batch_size", None) or data.train_batch_size
    name = dump_file_name(data.get("experiment_name", ""), data.get("project_name", ""), int(gbs), int(rollout.n))
    return Path(rollout.skip_dump_dir).joinpath(name).absolute()


class ReplayingGenerator:
    """Wraps a rollout generator (`RolloutGenerator`: `(prompts, state) -> samples`, with `.n`):
    replays `dump` when it exists, else generates and writes it (see the module docstring)."""

    def __init__(self, generator: Callable, dump: RolloutDump):
        self.generator = generator
        self.dump = dump
        self.n = generator.n
        if str(dump.path).startswith("/tmp/ray/session"):
            logger.warning(
                f"rollout.skip_dump_dir puts the rollout dump under Ray's session directory ({dump.path}), which "
                "Ray deletes; choose a directory of your own"
            )
        logger.info(f"rollout.skip_rollout: rollouts are replayed from (or first written to) {dump.path}")

    def __call__(self, batch: DataProto, state) -> DataProto:
        replayed = self.dump.load()
        if replayed is not None:
            _check_size(
                replayed, batch, self.n, f"rollout.skip_rollout: the rollout dump {self.dump.path}", "this step"
            )
            state.metrics["rollout/replayed"] = 1.0
            return replayed
        samples = self.generator(batch, state)
        self.dump.save(samples)
        logger.info(f"rollout.skip_rollout: wrote the rollout dump {self.dump.path}")
        state.metrics["rollout/replayed"] = 0.0
        return samples


def _check_size(replayed: DataProto, batch: DataProto, n: int, dump: str, step: str) -> None:
    """A replayed rollout must hold this step's prompts x rollout.n samples."""
    if len(replayed) != len(batch) * n:
        raise ValueError(
            f"{dump} holds {len(replayed)} samples, but {step} needs {len(batch)} prompts x rollout.n={n} = "
            f"{len(batch) * n}; delete it or point the dump directory elsewhere"
        )


# ------------------------------------------------------------------------- skip.rollout (per step)

GEN_BATCH_FILE = "gen_batch.dp"
META_FILE = "meta.json"


def step_dump_root(config) -> Path:
    """Upstream v0.9's directory of a run's per-step dumps (`skip.rollout`):
    `<dump_dir>/<experiment>_<project>/GBS<gbs>_N<n>_in<prompt length>_out<response length>`."""
    data, trainer = config.data, config.trainer
    gbs = data.get("gen_batch_size", None) or data.train_batch_size
    run = f"{trainer.get('experiment_name', '')}_{trainer.get('project_name', '')}"
    shape = f"GBS{int(gbs)}_N{int(config.actor_rollout_ref.rollout.n)}"
    shape += f"_in{data.max_prompt_length}_out{data.max_response_length}"
    return Path(config.skip.rollout.dump_dir).expanduser().resolve() / run / shape


class StepReplayingGenerator:
    """`skip.rollout`: at the steps listed in `steps`, replay a dumped rollout instead of generating.

    Each listed step's rollout lives in `<root>/<step>/` (`gen_batch.dp` and a `meta.json` naming the
    step, upstream's layout; the rows are written as `RolloutDump` writes them, never pickled).
    `action=cache`: a step replays its own dump, or generates and dumps it when there is none (the
    first run writes, later runs replay the same steps). `action=repeat`: a step replays its own dump,
    else the newest dump of an earlier step, else the oldest of a later one, else generates and
    dumps. Steps not listed generate as usual; validation never comes here. As with
    `rollout.skip_rollout`, whole rows are replayed, each scored against its own prompt.
    """

    def __init__(self, generator: Callable, root: Path, steps, action: str, current_step: Callable[[], int]):
        self.generator = generator
        self.n = generator.n
        self.root = Path(root)
        self.steps = {int(s) for s in steps}
        self.action = action
        self.current_step = current_step
        logger.info(f"skip.rollout: steps {sorted(self.steps)} replay ({action}) the dumps under {self.root}")

    def _ready(self, step: int) -> bool:
        d = self.root / str(step)
        return (d / GEN_BATCH_FILE).is_file() and (d / META_FILE).is_file()

    def _source_step(self, step: int) -> int | None:
        if self._ready(step):
            return step
        if self.action != "repeat":
            return None
        ready = sorted(int(p.name) for p in self.root.glob("*") if p.name.isdigit() and self._ready(int(p.name)))
        earlier = [s for s in ready if s < step]
        later = [s for s in ready if s > step]
        return earlier[-1] if earlier else (later[0] if later else None)

    def __call__(self, batch: DataProto, state) -> DataProto:
        step = int(self.current_step())
        if step not in self.steps:
            return self.generator(batch, state)
        source = self._source_step(step)
        if source is not None:
            path = self.root / str(source) / GEN_BATCH_FILE
            replayed = RolloutDump(path).load()
            if replayed is not None:
                _check_size(replayed, batch, self.n, f"skip.rollout: the dump {path}", f"step {step}")
                logger.info(f"skip.rollout: step {step} replays {path}")
                state.metrics["rollout/replayed"] = 1.0
                return replayed
        samples = self.generator(batch, state)
        out = self.root / str(step)
        out.mkdir(parents=True, exist_ok=True)
        RolloutDump(out / GEN_BATCH_FILE).save(samples)
        (out / META_FILE).write_text(json.dumps({"global_steps": step}))
        logger.info(f"skip.rollout: step {step} generated and wrote {out}")
        state.metrics["rollout/replayed"] = 0.0
        return samples
