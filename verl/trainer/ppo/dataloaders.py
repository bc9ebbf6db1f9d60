"""The driver's dataloaders: training prompts in a resumable order, validation prompts in one pass.

The training loader is a `StatefulDataLoader` (its position goes into each checkpoint) over the
sampler `create_rl_sampler` picks: a user's class (`data.sampler.class_path`) or the seeded,
resumable shuffle. It draws `data.gen_batch_size` prompts at a time (DAPO's dynamic sampling
generates more than it trains on; the composed default is `data.train_batch_size`).

`data` stays a DictConfig, as upstream keeps it; `verl.trainer.config.loader.data_value` reads one of
its keys, taking the data YAML's default when a caller's partial `data` mapping leaves the key out,
so no default is written twice.
"""

from __future__ import annotations

from verl.experimental.dataset.sampler import AbstractSampler
from verl.trainer.config.loader import data_value
from verl.utils.dataset.rl_dataset import collate_fn as default_collate_fn
from verl.utils.dataset.sampler import StatefulDataLoader, create_rl_dataloader
from verl.utils.dataset.sampler import create_rl_sampler as default_sampler
from verl.utils.import_utils import load_module


class SamplerConfigError(ValueError, AssertionError):
    """A `data.sampler` setting the trainer cannot use. It is also an AssertionError because upstream
    checks the same two conditions with `assert`, so code that catches that keeps working."""


def create_dataloaders(data_cfg, train_dataset, val_dataset=None, collate_fn=None, train_sampler=None):
    """(training loader, validation loader or None when there is no validation set)."""
    collate_fn = collate_fn or default_collate_fn
    batch_size = data_cfg.gen_batch_size or data_cfg.train_batch_size
    if batch_size > len(train_dataset):
        raise ValueError(
            f"data.train_batch_size={batch_size} is larger than the {len(train_dataset)} prompts of the "
            "training set (after filtering overlong prompts); lower data.train_batch_size or add data"
        )
    train = StatefulDataLoader(
        train_dataset,
        batch_size=batch_size,
        sampler=train_sampler or create_rl_sampler(data_cfg, train_dataset),
        collate_fn=collate_fn,
        drop_last=True,
        num_workers=data_cfg.dataloader_num_workers or 0,
    )
    val = None
    if val_dataset is not None and len(val_dataset) > 0:
        val = create_rl_dataloader(val_dataset, data_cfg, is_train=False, collate_fn=collate_fn)
    return train, val


def create_rl_sampler(data_config, dataset):
    """The training sampler: the class named by `data.sampler.class_path` / `class_name` (built as
    `cls(data_source=dataset, data_config=data_config)`, a subclass of
    `verl.experimental.dataset.sampler.AbstractSampler`), else the seeded, resumable shuffle
    (`data.shuffle`, `data.seed`).

    The class is built first and checked (it must be an `AbstractSampler`), then the loader: a
    custom sampler needs `data.dataloader_num_workers=0`, as loader workers would prefetch batches
    before a curriculum sampler could react to the last step (`AbstractCurriculumSampler.update`).
    Both failures raise `SamplerConfigError` (a ValueError and, as upstream's asserts, an AssertionError).
    Callers (and tests) pass a partial `data` mapping as well as the composed config (`data_value`).
    """
    class_path = data_value(data_config, "sampler.class_path")
    if not class_path:
        return default_sampler(data_config, dataset)

    class_name = data_value(data_config, "sampler.class_name")
    module = load_module(class_path, config_key="data.sampler.class_path")
    sampler_cls = getattr(module, class_name, None) if class_name else None
    if not isinstance(sampler_cls, type):
        raise AttributeError(
            f"data.sampler.class_name={class_name!r} is not a class defined in data.sampler.class_path={class_path!r}"
        )
    sampler = sampler_cls(data_source=dataset, data_config=data_config)
    if not isinstance(sampler, AbstractSampler):
        raise SamplerConfigError(
            f"data.sampler.class_name={class_name!r} must subclass verl.experimental.dataset.sampler.AbstractSampler"
        )
    num_workers = data_value(data_config, "dataloader_num_workers")
    if num_workers:
        raise SamplerConfigError(
            f"data.sampler.class_path={class_path!r} sets a custom sampler, which needs "
            f"data.dataloader_num_workers=0 (got {num_workers}): loader workers "
            "prefetch batches before the sampler sees the previous step's results"
        )
    return sampler
