"""The interface of a custom training sampler (upstream's `verl.experimental.dataset.sampler`).

`data.sampler.class_path` / `data.sampler.class_name` name a class the trainer builds as
`cls(data_source=train_dataset, data_config=config.data)` instead of its default seeded shuffle
(`verl.trainer.main_ppo.create_rl_sampler`). It must subclass `AbstractSampler` (a
`torch.utils.data.Sampler` of dataset indices).

A curriculum sampler subclasses `AbstractCurriculumSampler`: after every training step the trainer
calls `sampler.update(batch)` with that step's batch (rewards, advantages, `index` of the rows), so
the sampler can reorder what comes next. Because the order may change after every step, the
dataloader must not prefetch: `data.dataloader_num_workers` must be 0 (checked when the sampler
is built).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sized

from torch.utils.data import Sampler

__all__ = ["AbstractCurriculumSampler", "AbstractSampler"]


class AbstractSampler(Sampler[int]):
    """A sampler of dataset indices built from the dataset and the `data` config section."""

    @abstractmethod
    def __init__(self, data_source: Sized, data_config):
        pass


class AbstractCurriculumSampler(AbstractSampler):
    """A sampler that learns from each training batch (see the module docstring)."""

    @abstractmethod
    def update(self, batch) -> None:
        pass
