import pytest
import torch
from torch.utils.data import Dataset

from verl.utils.dataset.sampler import (
    StatefulDataLoader,
    StatefulRandomSampler,
    create_rl_dataloader,
    create_rl_sampler,
)


class Range(Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"idx": torch.tensor(i)}


def _loader(n=10, batch_size=3, num_workers=0, seed=7):
    config = {"train_batch_size": batch_size, "seed": seed, "shuffle": True, "dataloader_num_workers": num_workers}
    return create_rl_dataloader(Range(n), config, is_train=True)


def _ids(batch):
    return batch["idx"].tolist()


def test_epoch_order_is_a_seeded_permutation_that_changes_per_epoch():
    a, b = StatefulRandomSampler(50, seed=3), StatefulRandomSampler(50, seed=3)
    assert sorted(a.epoch_order(0)) == list(range(50))
    assert a.epoch_order(0) == b.epoch_order(0)
    assert a.epoch_order(0) != a.epoch_order(1)
    assert a.epoch_order(0) != StatefulRandomSampler(50, seed=4).epoch_order(0)
    assert StatefulRandomSampler(5, shuffle=False).epoch_order(3) == [0, 1, 2, 3, 4]


def test_sampler_alone_moves_to_the_next_epoch_after_a_full_pass():
    sampler = StatefulRandomSampler(6, seed=1)
    assert list(sampler) == sampler.epoch_order(0)
    assert list(sampler) == sampler.epoch_order(1)
    sampler.set_epoch(5, start=4)
    assert list(sampler) == sampler.epoch_order(5)[4:]


def test_train_loader_drops_the_last_partial_batch_and_len_counts_full_epoch():
    loader = _loader(n=10, batch_size=3)
    assert len(loader) == 3
    batches = [_ids(b) for b in loader]
    assert [len(b) for b in batches] == [3, 3, 3]
    assert sum(batches, []) == loader.sampler.epoch_order(0)[:9]


def _uninterrupted(num_epochs, **kwargs):
    loader = _loader(**kwargs)
    return [_ids(batch) for _ in range(num_epochs) for batch in loader]


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("stop_after", [1, 2, 3, 4])  # 3 = exactly at the epoch boundary
def test_resume_yields_the_remaining_batches_then_identical_epochs(num_workers, stop_after):
    reference = _uninterrupted(3)
    first = _loader(num_workers=num_workers)
    seen = []
    for _ in range(3):
        for batch in first:
            seen.append(_ids(batch))
            if len(seen) == stop_after:
                break
        if len(seen) == stop_after:
            break
    state = first.state_dict()  # taken while the DataLoader workers have prefetched further

    resumed = _loader(num_workers=num_workers)
    resumed.load_state_dict(state)
    while len(seen) < len(reference):
        for batch in resumed:
            seen.append(_ids(batch))
    assert seen == reference


def test_state_saved_after_the_last_batch_of_an_epoch_resumes_at_the_next_epoch():
    loader = _loader()
    for batch in loader:
        last = _ids(batch)
    state = None
    loader = _loader()
    for i, _batch in enumerate(loader):
        if i == len(loader) - 1:
            state = loader.state_dict()  # still inside the loop of epoch 0
    assert state["epoch"] == 1 and state["num_consumed_samples"] == 0
    assert loader.state_dict()["epoch"] == 1  # the live loader agrees, not epoch 2
    resumed = _loader()
    resumed.load_state_dict(state)
    assert [_ids(b) for b in resumed] == _uninterrupted(2)[3:]
    assert last == _uninterrupted(1)[-1]


def test_breaking_out_and_iterating_again_continues_where_the_caller_stopped():
    loader = _loader()
    got = []
    for batch in loader:
        got.append(_ids(batch))
        break
    got.extend(_ids(b) for b in loader)
    assert got == _uninterrupted(1)


def test_resume_with_a_new_batch_size_keeps_the_sample_position():
    first = _loader(n=12, batch_size=4)
    it = iter(first)
    consumed = next(it)["idx"].tolist()
    state = first.state_dict()
    resumed = _loader(n=12, batch_size=2)
    resumed.load_state_dict(state)
    rest = sum((_ids(b) for b in resumed), [])
    assert consumed + rest == first.sampler.epoch_order(0)


def test_resume_on_a_different_dataset_length_restarts_the_epoch():
    first = _loader(n=10)
    next(iter(first))
    state = first.state_dict()
    resumed = _loader(n=12)
    resumed.load_state_dict(state)
    assert resumed.state_dict()["num_consumed_samples"] == 0
    assert sum((_ids(b) for b in resumed), []) == resumed.sampler.epoch_order(0)[:12]


def test_unshuffled_sampler_is_sequential():
    sampler = create_rl_sampler({"shuffle": False, "seed": 1}, Range(5))
    assert list(sampler) == [0, 1, 2, 3, 4]


def test_validation_loader_is_one_ordered_batch_with_nothing_dropped():
    loader = create_rl_dataloader(Range(7), {"train_batch_size": 4}, is_train=False)
    assert [_ids(b) for b in loader] == [list(range(7))]
    loader = create_rl_dataloader(Range(7), {"val_batch_size": 4}, is_train=False)
    assert [_ids(b) for b in loader] == [[0, 1, 2, 3], [4, 5, 6]]


def test_batch_larger_than_the_dataset_is_a_clear_error():
    with pytest.raises(ValueError, match="data.train_batch_size=8 is larger than the 5 prompts"):
        create_rl_dataloader(Range(5), {"train_batch_size": 8}, is_train=True)


def test_stateful_loader_rejects_nonpositive_batch_size():
    with pytest.raises(ValueError, match="batch_size"):
        StatefulDataLoader(Range(3), 0, StatefulRandomSampler(3))


def test_a_dataset_that_grows_is_drawn_whole_from_the_next_epoch_on():
    """Upstream's `on_batch_end` datasets add rows during training: the epoch in progress keeps its order,
    the next one covers every row."""
    from verl.utils.dataset.sampler import StatefulRandomSampler

    rows = list(range(4))
    sampler = StatefulRandomSampler(len(rows), seed=3, data_source=rows)
    first = iter(sampler)
    drawn = [next(first), next(first)]
    rows.extend([4, 5])  # the dataset grows mid-epoch
    drawn += list(first)
    assert sorted(drawn) == [0, 1, 2, 3]
    second = list(sampler)
    assert sorted(second) == [0, 1, 2, 3, 4, 5] and len(sampler) == 6
