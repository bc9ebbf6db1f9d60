"""Custom and curriculum samplers: main_ppo.create_rl_sampler, the resumable loader around them, and
the trainer's per-step `update(batch)` hook."""

import textwrap
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf
from torch.utils.data import Dataset

from verl.experimental.dataset.sampler import AbstractCurriculumSampler, AbstractSampler
from verl.trainer.main_ppo import create_rl_sampler
from verl.trainer.ppo.dataloaders import SamplerConfigError
from verl.utils.dataset.sampler import StatefulDataLoader, StatefulRandomSampler

SAMPLER_SOURCE = textwrap.dedent(
    """
    from verl.experimental.dataset.sampler import AbstractCurriculumSampler


    class HardestFirst(AbstractCurriculumSampler):
        '''Visits indices in descending order of a per-index difficulty, which update() raises.'''

        def __init__(self, data_source, data_config):
            self.n = len(data_source)
            self.boost = data_config.get("boost", 1)
            self.difficulty = [0] * self.n
            self.updates = 0

        def __iter__(self):
            return iter(sorted(range(self.n), key=lambda i: (-self.difficulty[i], i)))

        def __len__(self):
            return self.n

        def update(self, batch):
            self.updates += 1
            for i in batch["index"]:
                self.difficulty[i] += self.boost

        def state_dict(self):
            return {"difficulty": list(self.difficulty)}

        def load_state_dict(self, state):
            self.difficulty = list(state["difficulty"])


    class NotASampler:
        def __init__(self, data_source, data_config):
            pass
    """
)


class Range(Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"idx": torch.tensor(i)}


@pytest.fixture
def sampler_file(tmp_path):
    path = tmp_path / "my_sampler.py"
    path.write_text(SAMPLER_SOURCE)
    return str(path)


def _data_config(path=None, name=None, **extra):
    return OmegaConf.create(
        {
            "sampler": {"class_path": path, "class_name": name},
            "shuffle": True,
            "seed": 5,
            "dataloader_num_workers": 0,
            **extra,
        }
    )


def test_without_a_class_the_default_seeded_shuffle_is_used():
    sampler = create_rl_sampler(_data_config(), Range(6))
    assert isinstance(sampler, StatefulRandomSampler) and sampler.seed == 5 and sampler.shuffle


def test_custom_class_is_built_from_the_dataset_and_data_config(sampler_file):
    sampler = create_rl_sampler(_data_config(sampler_file, "HardestFirst", boost=3), Range(6))
    assert isinstance(sampler, AbstractCurriculumSampler) and isinstance(sampler, AbstractSampler)
    assert sampler.n == 6 and sampler.boost == 3


def test_custom_class_errors(sampler_file):
    with pytest.raises(ValueError, match="dataloader_num_workers=0"):
        create_rl_sampler(_data_config(sampler_file, "HardestFirst", dataloader_num_workers=2), Range(6))
    with pytest.raises(SamplerConfigError, match="must subclass"):
        create_rl_sampler(_data_config(sampler_file, "NotASampler"), Range(6))
    # the class is checked before the loader, as upstream does; both errors are also AssertionErrors
    with pytest.raises(AssertionError, match="must subclass"):
        create_rl_sampler(_data_config(sampler_file, "NotASampler", dataloader_num_workers=2), Range(6))
    with pytest.raises(AttributeError, match="'Missing' is not a class"):
        create_rl_sampler(_data_config(sampler_file, "Missing"), Range(6))
    # a partial `data` mapping without dataloader_num_workers has the YAML's 8 workers (upstream's default too)
    partial = OmegaConf.create({"sampler": {"class_path": sampler_file, "class_name": "HardestFirst"}})
    with pytest.raises(SamplerConfigError, match=r"dataloader_num_workers=0 \(got 8\)") as err:
        create_rl_sampler(partial, Range(6))
    assert isinstance(err.value, ValueError) and isinstance(err.value, AssertionError)


def test_loader_over_a_curriculum_sampler_follows_updates_and_resumes(sampler_file):
    sampler = create_rl_sampler(_data_config(sampler_file, "HardestFirst"), Range(6))
    loader = StatefulDataLoader(Range(6), batch_size=2, sampler=sampler)
    epoch = iter(loader)  # the trainer draws one epoch from one iterator
    assert next(epoch)["idx"].tolist() == [0, 1]
    sampler.update({"index": [5, 4]})  # the trainer's hook after the step
    state = loader.state_dict()
    assert state["sampler"] == {"difficulty": [0, 0, 0, 0, 1, 1]} and state["num_consumed_samples"] == 2
    assert next(epoch)["idx"].tolist() == [2, 3]  # this epoch's order was drawn when it began
    assert next(epoch)["idx"].tolist() == [4, 5]
    assert [b["idx"].tolist() for b in loader] == [[4, 5], [0, 1], [2, 3]]  # the next epoch: hardest first

    # resuming from the state saved after one batch: the restored sampler's order, one batch skipped
    resumed = StatefulDataLoader(
        Range(6), batch_size=2, sampler=create_rl_sampler(_data_config(sampler_file, "HardestFirst"), Range(6))
    )
    resumed.load_state_dict(state)
    assert resumed.sampler.difficulty == [0, 0, 0, 0, 1, 1]
    assert [b["idx"].tolist() for b in resumed] == [[0, 1], [2, 3]]
    assert resumed.epoch == 1 and resumed.num_consumed_samples == 0


def test_trainer_hands_each_steps_batch_to_a_curriculum_sampler(sampler_file):
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    sampler = create_rl_sampler(_data_config(sampler_file, "HardestFirst"), Range(6))
    trainer = SimpleNamespace(train_dataloader=SimpleNamespace(sampler=sampler), _last_batch={"index": [2]})
    RayPPOTrainer._update_curriculum(trainer)
    assert sampler.updates == 1 and sampler.difficulty[2] == 1
    plain = SimpleNamespace(train_dataloader=SimpleNamespace(sampler=StatefulRandomSampler(6)), _last_batch=None)
    RayPPOTrainer._update_curriculum(plain)  # an ordinary sampler has no update: nothing happens
