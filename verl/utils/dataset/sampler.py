"""Resumable data order for RL training: a seeded sampler and a dataloader whose position can be saved.

A checkpoint taken after step k must resume with exactly the prompts step k+1 would have seen, and the
epochs after it must be the ones an uninterrupted run sees. Two pieces do this:

- ``StatefulRandomSampler``: the order of epoch ``e`` is a pure function of ``(seed, e)`` (a numpy
  generator seeded with both), so it can be recomputed after a restart instead of replaying a random
  stream. It starts at ``start`` items into the epoch.
- ``StatefulDataLoader``: wraps ``torch.utils.data.DataLoader`` and counts the samples of the batches it
  has *handed to the caller*. The sampler's own iterator position cannot be trusted for this: worker
  processes prefetch batches, so the sampler runs ahead of what training consumed. Before each pass the
  loader sets the sampler to (epoch, consumed samples), so a pass always continues where the caller
  stopped, also after breaking out of a loop. ``state_dict()`` / ``load_state_dict()`` are what the
  trainer checkpoints (upstream's ``train_dataloader.state_dict()``; torchdata is not needed).

Consumption is stored in samples, not batches, so a resumed run may change ``train_batch_size``; a changed
dataset length invalidates the position, which is then reset to the start of the saved epoch with a warning.

A user sampler (``data.sampler.class_path``, e.g. a curriculum sampler) has no ``set_epoch(start=)``: the
loader then starts the sampler's own iteration over and skips the batches already consumed in the
epoch, and saves and restores the sampler's ``state_dict()`` when it has one. A sampler whose order
depends on what it has seen resumes with the order it produces after restoring that state, so in the
interrupted epoch a sample may then come twice or not at all.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import numpy as np
from torch.utils.data import DataLoader, Dataset, Sampler

from verl.utils.logging_utils import get_logger

logger = get_logger(__name__)


class StatefulRandomSampler(Sampler[int]):
    """Indices of one epoch, in an order fixed by ``(seed, epoch)``, starting ``start`` items in.

    Used alone (with a plain DataLoader) it moves to the next epoch when an epoch is exhausted; under
    ``StatefulDataLoader`` the loader sets epoch and start before every pass.
    """

    def __init__(self, data_len: int, seed: int = 1, shuffle: bool = True, data_source=None):
        if data_len < 0:
            raise ValueError(f"data_len must be >= 0, got {data_len}")
        self.data_len = int(data_len)
        # the dataset, when given: its length is read again when an epoch begins, so rows a dataset adds to
        # itself (upstream's `on_batch_end` hook) are drawn from the next epoch on
        self.data_source = data_source
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.epoch = 0
        self.start = 0

    def epoch_order(self, epoch: int) -> list[int]:
        """The full index order of ``epoch``."""
        if not self.shuffle:
            return list(range(self.data_len))
        return np.random.default_rng([self.seed, epoch]).permutation(self.data_len).tolist()

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        if not 0 <= start <= self.data_len:
            raise ValueError(f"start must be within [0, {self.data_len}], got {start}")
        self.epoch, self.start = int(epoch), int(start)

    def __iter__(self) -> Iterator[int]:
        epoch, start = self.epoch, self.start
        if start == 0 and self.data_source is not None:
            self.data_len = len(self.data_source)
        yield from self.epoch_order(epoch)[start:]
        self.epoch, self.start = epoch + 1, 0

    def __len__(self) -> int:
        return self.data_len - self.start

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "start": self.start, "seed": self.seed, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict) -> None:
        self.seed, self.shuffle = int(state["seed"]), bool(state["shuffle"])
        self.set_epoch(state["epoch"], min(int(state["start"]), self.data_len))


class StatefulDataLoader:
    """A DataLoader over a ``StatefulRandomSampler`` that can save and restore its position.

    Iterating yields the remaining batches of the current epoch, then moves to the next epoch (the
    ``for epoch in ...: for batch in loader`` loop of the trainer). ``len()`` is the number of batches
    of a full epoch.
    """

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        sampler: Sampler,
        collate_fn: Callable | None = None,
        drop_last: bool = True,
        num_workers: int = 0,
        **dataloader_kwargs,
    ):
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.dataset = dataset
        self.batch_size = int(batch_size)
        self.sampler = sampler
        self._positionable = isinstance(sampler, StatefulRandomSampler)
        self.drop_last = drop_last
        self._loader = DataLoader(
            dataset,
            batch_size=self.batch_size,
            sampler=sampler,
            collate_fn=collate_fn,
            drop_last=drop_last,
            num_workers=num_workers,
            **dataloader_kwargs,
        )
        self.epoch = 0
        self.num_consumed_samples = 0  # samples of the current epoch handed to the caller

    def _num_samples_per_epoch(self) -> int:
        n = len(self.dataset)
        return n - n % self.batch_size if self.drop_last else n

    def __len__(self) -> int:
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def _position(self) -> tuple[int, int]:
        """(epoch, consumed samples), with an exhausted epoch counted as the start of the next one, so a
        run resumed at an epoch boundary yields the next epoch at once instead of an empty pass."""
        if self.num_consumed_samples >= self._num_samples_per_epoch():
            return self.epoch + 1, 0
        return self.epoch, self.num_consumed_samples

    def __iter__(self) -> Iterator:
        self.epoch, self.num_consumed_samples = self._position()
        epoch = self.epoch
        skip_batches = 0
        if self._positionable:
            self.sampler.set_epoch(epoch, start=self.num_consumed_samples)
        else:  # a user sampler restarts its iteration: pass over the batches this epoch already used
            skip_batches = self.num_consumed_samples // self.batch_size
        n = len(self.dataset)
        for batch in self._loader:
            if skip_batches:
                skip_batches -= 1
                continue
            self.num_consumed_samples = min(self.num_consumed_samples + self.batch_size, n)
            yield batch
        if self.epoch == epoch:  # unless load_state_dict moved the position meanwhile
            self.epoch, self.num_consumed_samples = epoch + 1, 0

    def state_dict(self) -> dict:
        epoch, consumed = self._position()
        return {
            "epoch": epoch,
            "num_consumed_samples": consumed,
            "dataset_len": len(self.dataset),
            "sampler": self.sampler.state_dict() if hasattr(self.sampler, "state_dict") else None,
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("sampler") is not None and hasattr(self.sampler, "load_state_dict"):
            self.sampler.load_state_dict(state["sampler"])
        self.epoch = int(state["epoch"])
        self.num_consumed_samples = int(state["num_consumed_samples"])
        if int(state["dataset_len"]) != len(self.dataset):
            logger.warning(
                "the saved data position is for a dataset of %d rows but this one has %d; the data order of "
                "epoch %d restarts from its beginning",
                state["dataset_len"],
                len(self.dataset),
                self.epoch,
            )
            self.num_consumed_samples = 0


def create_rl_sampler(data_config, dataset: Dataset) -> StatefulRandomSampler:
    """The training sampler: shuffled with ``data.seed`` when ``data.shuffle`` (default True)."""
    seed = data_config.get("seed")
    return StatefulRandomSampler(
        len(dataset), seed=1 if seed is None else seed, shuffle=data_config.get("shuffle", True), data_source=dataset
    )


def create_rl_dataloader(
    dataset: Dataset, data_config, is_train: bool = True, collate_fn: Callable | None = None
) -> StatefulDataLoader:
    """The train (``is_train``) or validation dataloader described by the ``data`` config section.

    Train: ``data.train_batch_size`` prompts per batch, ``drop_last`` so every step has a full batch,
    order from ``create_rl_sampler``. Validation: ``data.val_batch_size`` (default: the whole set in one
    batch), shuffled only if ``data.validation_shuffle``, nothing dropped.
    ``data.dataloader_num_workers`` (default 0) worker processes load items.
    """
    from verl.utils.dataset.rl_dataset import collate_fn as default_collate_fn

    if len(dataset) == 0:
        raise ValueError("the dataset is empty (after filtering overlong prompts); check data.max_prompt_length")
    seed = data_config.get("seed")
    seed = 1 if seed is None else seed
    if is_train:
        batch_size = int(data_config["train_batch_size"])
        if batch_size > len(dataset):
            raise ValueError(
                f"data.train_batch_size={batch_size} is larger than the {len(dataset)} prompts of the training set "
                "(after filtering overlong prompts), so an epoch would have no full batch; lower "
                "data.train_batch_size or add data"
            )
        sampler = create_rl_sampler(data_config, dataset)
    else:
        batch_size = data_config.get("val_batch_size") or len(dataset)
        sampler = StatefulRandomSampler(len(dataset), seed=seed, shuffle=data_config.get("validation_shuffle", False))
    return StatefulDataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        collate_fn=collate_fn or default_collate_fn,
        drop_last=is_train,
        num_workers=int(data_config.get("dataloader_num_workers", 0) or 0),
    )
