"""Upstream's `RolloutSkip`, for recipes whose own training loop constructs it when
`rollout.skip_rollout` is set.

`RolloutSkip(config, rollout_wg).wrap_generate_sequences()` replaces the worker group's
`generate_sequences`: the first call whose dump file is missing generates and writes the file;
every later call, in this run and in the next ones, loads the file instead of generating. The file
is upstream's: `<rollout.skip_dump_dir>/{experiment}_{project}_GBS{gbs}__N{n}` (`dump_file_name`). Progress is printed to stdout with upstream's
`[RolloutSkip()]` messages. `RolloutDump` (one dump file) and `dump_file_name` are shared with
`main_ppo`'s replay.

What it replays is the worker group's raw output, as upstream: a recipe's loop joins it to the
current step's prompt rows, so from the second step on the rewards compare the first rollout's
responses with that step's ground truth. That is upstream's tool for debugging and timing the
phases after generation, and a warning says so when the patch is applied; `main_ppo`'s
`rollout.skip_rollout` (verl/trainer/ppo/rollout_skip.py) replays whole rows instead, each scored
against its own prompt.

Deliberate difference: the file is written with `torch.save` of plain tensors and read with
`weights_only=True` (`RolloutDump`), not pickled, since `/tmp` is shared and unpickling a file
found there would run whatever it says; a dump that does not load is reported and regenerated, as
upstream does with any unreadable dump.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from verl.protocol import DataProto
from verl.utils.checkpoint.safe_load import from_plain, to_plain, torch_load

__all__ = ["DataProto", "RolloutDump", "RolloutSkip", "dump_file_name"]

logger = logging.getLogger(__name__)

DEFAULT_DUMP_DIR = "/tmp/verl/rollout_dump"  # upstream's, for a config without rollout.skip_dump_dir


def dump_file_name(experiment: str | None, project: str | None, gbs: int, n: int) -> str:
    """Upstream's dump file name: `{experiment}_{project}_GBS{gbs}__N{n}` (empty names stay empty)."""
    return f"{experiment or ''}_{project or ''}_GBS{gbs}__N{n}"


class RolloutDump:
    """One dumped rollout at `path`: `load()` returns it (None when there is none to read), `save()` writes it."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def load(self) -> DataProto | None:
        if not self.path.exists():
            return None
        try:
            return from_plain(torch_load(str(self.path), "the rollout dump"))
        except Exception as err:  # upstream's rule: an unreadable dump is generated anew and overwritten
            logger.warning(
                "rollout.skip_rollout: could not read the rollout dump %s (%s); generating and overwriting it. "
                "Point rollout.skip_dump_dir elsewhere to keep that file",
                self.path,
                err,
            )
            return None

    def save(self, batch: DataProto) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_name(self.path.name + f".{os.getpid()}.partial")
        torch.save(to_plain(batch), partial)
        os.replace(partial, self.path)  # a crash mid-write never leaves a truncated dump behind


class RolloutSkip:
    """Generate once, then replay the dump (see the module docstring).

    Args:
        config: the trainer config (a DictConfig or nested mappings): `actor_rollout_ref.rollout`
            gives `n` and `skip_dump_dir`; `data` gives `gen_batch_size` (else `train_batch_size`).
        rollout_wg: the worker group whose `generate_sequences` is replaced.
    """

    print_mark = "[RolloutSkip()]"

    def __init__(self, config, rollout_wg):
        self.rollout_config = config.actor_rollout_ref.rollout
        data = config.data
        self.exp_name = data.get("experiment_name", "") or ""
        self.project_name = data.get("project_name", "") or ""
        self.n = int(self.rollout_config.get("n", 0))
        self.gbs = int(data.get("gen_batch_size", None) or data.get("train_batch_size", 0))
        self.dumped_dir = Path(self.rollout_config.get("skip_dump_dir", DEFAULT_DUMP_DIR))
        self.dumped_dir.mkdir(parents=True, exist_ok=True)
        if str(self.dumped_dir.absolute()).startswith("/tmp/ray/session"):
            logger.warning(
                "rollout.skip_dump_dir puts the rollout dump under Ray's session directory (%s), which Ray "
                "deletes; choose a directory of your own",
                self.dumped_dir.absolute(),
            )
        print(f"{self.print_mark} Rollout skip dump path set to: {self.dumped_dir.absolute()}", flush=True)
        self._rollout_wg = rollout_wg
        self._dump = RolloutDump(self.curr_path_dump)

    @property
    def curr_path_dump(self) -> Path:
        return self.dumped_dir.joinpath(dump_file_name(self.exp_name, self.project_name, self.gbs, self.n)).absolute()

    def wrap_generate_sequences(self) -> None:
        """Replace `rollout_wg.generate_sequences` with the replaying one."""
        generate_sequences = self._rollout_wg.generate_sequences

        def generate_or_replay(batch, **kwargs):
            output = self.try_load()
            if output is None:
                output = generate_sequences(batch, **kwargs)
                self.dump(output)
            return output

        self._rollout_wg.generate_sequences = generate_or_replay
        logger.warning(
            "rollout.skip_rollout: every step after the first replays the first rollout's raw output, which "
            "the training loop joins to that step's prompts, so its rewards score old responses against new "
            "ground truth (a tool for timing and debugging the phases after generation). "
            "python -m verl.trainer.main_ppo replays whole rows instead"
        )
        print(f"{self.print_mark} Successfully patched `actor_rollout_wg.generate_sequences()`", flush=True)

    def try_load(self) -> DataProto | None:
        """The dumped rollout, or None when there is none to read (the next call generates)."""
        if not self.curr_path_dump.exists():
            print(
                f"{self.print_mark} No data dump found at {self.curr_path_dump}. "
                "The trainer will generate and automatically dump the data for this first run.",
                flush=True,
            )
            return None
        batch = self._dump.load()
        if batch is not None:
            print(f"{self.print_mark} Successfully load pre-generated data from {self.curr_path_dump}", flush=True)
        return batch

    def dump(self, outputs: DataProto) -> None:
        """Write `outputs` as the dump; a failed write is reported and the run goes on generating."""
        try:
            self._dump.save(outputs)
        except OSError as err:
            logger.error("%s could not write the rollout dump %s: %s", self.print_mark, self.curr_path_dump, err)
            return
        print(f"{self.print_mark} Successfully dump data in {self.curr_path_dump}", flush=True)
