"""Each prompt is rendered and tokenised once: the items, and the batches the driver draws, are the
ones a per-row render + tokenise gives, first access and every access after it, across a resume."""

import copy

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from torch.utils.data import Dataset

from verl.trainer.ppo.dataloaders import create_dataloaders
from verl.trainer.ppo.rollout_source import PromptStream
from verl.utils.dataset.arith import make_arith_rows
from verl.utils.dataset.rl_dataset import RLHFDataset
from verl.utils.dataset.sampler import StatefulDataLoader


def _rows():
    # Prompts of different lengths (word problems are long), so truncation and padding both occur.
    plain, _ = make_arith_rows(num_train=24, num_test=1, digits=2, ops="+-", seed=3)
    story, _ = make_arith_rows(num_train=8, num_test=1, digits=1, ops="+", style="word", seed=4)
    for row in story:
        row["extra_info"]["index"] += 100
    return plain[:12] + story + plain[12:]  # the long ones in the middle: dropping them shifts rows


@pytest.fixture
def data_file(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(_rows()), path)
    return str(path)


def reference_item(row: dict, tokenizer, config: dict) -> dict:
    """What an item must be, written out from the data format's definition: render, tokenise,
    truncate, left-pad; every other column passed through."""
    row = copy.deepcopy(row)
    messages = row.pop("prompt")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    limit = config["max_prompt_length"]
    if len(ids) > limit:
        ids = {"left": ids[-limit:], "right": ids[:limit], "middle": ids[: limit // 2] + ids[-(limit - limit // 2) :]}[
            config["truncation"]
        ]
    pad = limit - len(ids)
    row["input_ids"] = torch.tensor([tokenizer.pad_token_id] * pad + ids)
    row["attention_mask"] = torch.tensor([0] * pad + [1] * len(ids))
    row["position_ids"] = torch.tensor([0] * pad + list(range(len(ids))))
    row["raw_prompt_ids"] = ids
    if config.get("return_raw_chat"):
        row["raw_prompt"] = messages
    if config.get("return_full_prompt"):
        row["full_prompts"] = text
    row["index"] = row["extra_info"]["index"]
    return row


def assert_same_item(got: dict, want: dict, where: str) -> None:
    assert sorted(got) == sorted(want), where
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert got[key].dtype == torch.long, (where, key, got[key].dtype)
            assert torch.equal(got[key], value), (where, key, got[key].tolist(), value.tolist())
        else:
            assert got[key] == value and type(got[key]) is type(value), (where, key, got[key], value)


class _NoTokenizer:
    """Stands in for the tokenizer once every prompt has been tokenised: any use is a failure."""

    def __getattr__(self, name):
        raise AssertionError(f"the tokenizer's {name!r} was used after every prompt had been tokenised")

    def __call__(self, *args, **kwargs):
        raise AssertionError("the tokenizer was called after every prompt had been tokenised")


CONFIGS = {
    # ids computed by the start-up length check (the default run's setting: truncation='error')
    "checked": {"max_prompt_length": 80, "truncation": "error", "filter_overlong_prompts": False},
    # no start-up check: tokenised lazily on first access, then kept
    "lazy_left": {"max_prompt_length": 24, "truncation": "left", "filter_overlong_prompts": False},
    "lazy_middle": {
        "max_prompt_length": 23,
        "truncation": "middle",
        "filter_overlong_prompts": False,
        "return_raw_chat": True,
        "return_full_prompt": True,
    },
    # start-up check that drops the long story prompts; the kept ids must stay aligned with the rows
    "filtered": {
        "max_prompt_length": 30,
        "truncation": "right",
        "filter_overlong_prompts": True,
        "return_full_prompt": True,
    },
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_items_match_a_per_row_render_and_tokenise_on_every_access(name, data_file, char_tokenizer):
    config = CONFIGS[name]
    dataset = RLHFDataset(data_file, char_tokenizer, config)
    by_index = {row["extra_info"]["index"]: row for row in _rows()}
    if name == "filtered":
        assert 0 < len(dataset) < len(by_index), "the test needs some prompts dropped and some kept"
    for access in ("first", "second"):
        if access == "second":
            dataset.tokenizer = _NoTokenizer()
        for i in range(len(dataset)):
            got = dataset[i]
            want = reference_item(by_index[got["index"]], char_tokenizer, config)
            assert_same_item(got, want, f"{name}, {access} access, item {i}")


def test_the_checked_dataset_never_tokenises_in_getitem(data_file, char_tokenizer):
    dataset = RLHFDataset(data_file, char_tokenizer, CONFIGS["checked"])
    dataset.tokenizer = _NoTokenizer()  # the start-up check already has every prompt's ids
    assert len(dataset[len(dataset) - 1]["raw_prompt_ids"]) > 0


def test_truncation_and_padding_are_exercised(char_tokenizer):
    """Some prompts are longer than every lazy config's limit and some shorter (else the equality
    tests above would not cover truncation or padding)."""
    lengths = [
        len(
            char_tokenizer(char_tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False))[
                "input_ids"
            ]
        )
        for r in _rows()
    ]
    for name in ("lazy_left", "lazy_middle", "filtered"):
        limit = CONFIGS[name]["max_prompt_length"]
        assert max(lengths) > limit > min(lengths), (name, limit, sorted(set(lengths)))


@pytest.mark.parametrize("name", ["checked", "lazy_middle"])
def test_rows_a_subclass_changes_after_init_are_tokenised_as_they_are_now(name, data_file, char_tokenizer):
    """docs/howto.md's custom dataset rewrites `self.rows` after `__init__`; one that drops or reorders
    rows must not get another row's cached ids either."""
    config = CONFIGS[name]
    dataset = RLHFDataset(data_file, char_tokenizer, config)
    for i in range(len(dataset)):
        dataset[i]  # every row cached as read from the file
    rows = dataset.rows[::-1][: len(dataset.rows) - 3]  # reordered and shortened: cache slots misaligned
    for row in rows[::2]:
        row["prompt"] = [{**m, "content": m["content"].upper()} for m in row["prompt"]]
    for row in rows[1::4]:
        row["prompt"][0]["content"] += " now"  # changed in place, the same list object
    dataset.rows = rows
    dataset._origins = dataset._origins[: len(rows)]
    for i in range(len(dataset)):
        want = reference_item(copy.deepcopy(rows[i]), char_tokenizer, config)
        assert_same_item(dataset[i], want, f"{name}, changed row {i}")


def test_changing_an_item_does_not_change_the_dataset(data_file, char_tokenizer):
    dataset = RLHFDataset(data_file, char_tokenizer, CONFIGS["lazy_middle"])
    first = dataset[0]
    first["extra_info"]["index"] = -5
    first["reward_model"]["ground_truth"] = "changed"
    first["raw_prompt"][0]["content"] = "changed"
    first["raw_prompt_ids"].append(7)
    again = dataset[0]
    assert again["extra_info"]["index"] != -5
    assert again["reward_model"]["ground_truth"] != "changed"
    assert again["raw_prompt"][0]["content"] != "changed"
    assert again["raw_prompt_ids"] == again["input_ids"][again["attention_mask"].bool()].tolist()


class ReferenceDataset(Dataset):
    """The uncached path: every access renders and tokenises its row again."""

    def __init__(self, rows, tokenizer, config):
        self.rows, self.tokenizer, self.config = rows, tokenizer, config

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, item):
        return reference_item(self.rows[item], self.tokenizer, self.config)


def _batches(stream: PromptStream, num: int) -> list:
    return [stream() for _ in range(num)]


def assert_same_batch(got, want, where: str) -> None:
    assert sorted(got.batch.keys()) == sorted(want.batch.keys()), where
    for key in sorted(want.batch.keys()):
        assert torch.equal(got.batch[key], want.batch[key]), (where, key)
    assert sorted(got.non_tensor_batch) == sorted(want.non_tensor_batch), where
    for key, value in want.non_tensor_batch.items():
        assert got.non_tensor_batch[key].dtype == value.dtype, (where, key)
        assert got.non_tensor_batch[key].tolist() == value.tolist(), (where, key)


def test_driver_batches_equal_the_uncached_path_across_epochs_and_a_resume(data_file, char_tokenizer):
    config = dict(CONFIGS["checked"], return_raw_chat=True)
    data_cfg = OmegaConf.create(
        {"train_batch_size": 6, "gen_batch_size": None, "shuffle": True, "seed": 5, "dataloader_num_workers": 0}
    )
    dataset = RLHFDataset(data_file, char_tokenizer, config)
    reference = ReferenceDataset([dict(r) for r in dataset.rows], char_tokenizer, config)
    step = [1]

    def stream_over(ds, state=None):
        loader, _ = create_dataloaders(data_cfg, ds)
        assert isinstance(loader, StatefulDataLoader)
        if state is not None:
            loader.load_state_dict(state)
        return loader, PromptStream(loader, current_step=lambda: step[0])

    # 32 prompts / 6 per batch = 5 batches an epoch: 12 batches cross two epoch boundaries.
    _, want_stream = stream_over(reference)
    want = []
    for step[0] in range(1, 13):
        want.append(want_stream())

    loader, got_stream = stream_over(dataset)
    got = []
    for step[0] in range(1, 8):
        got.append(got_stream())
    state = loader.state_dict()
    _, resumed = stream_over(RLHFDataset(data_file, char_tokenizer, config), state)
    for step[0] in range(8, 13):
        got.append(resumed())

    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_same_batch(g, w, f"step {i + 1}")
    orders = [tuple(b.non_tensor_batch["index"].tolist()) for b in want[:5]]
    assert len(set(np.concatenate(orders).tolist())) == 30, "the sampler's shuffle should cover the epoch"


def test_the_bundled_tokenizer_gives_the_per_row_ids_from_the_start_up_batch(tmp_path):
    """The default run's tokenizer (the bundled model's, a real BPE one): the ids kept from the
    batched start-up call equal a per-row render + tokenise for plain and word problems."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from verl.trainer.config.loader import register_resolvers
    from verl.utils.tokenizer import hf_tokenizer

    register_resolvers()
    path = OmegaConf.create({"p": "${verl_asset:arith-tiny}"}).p
    tokenizer = hf_tokenizer(path)
    plain, _ = make_arith_rows(num_train=100, num_test=1, digits=3, ops="+-*", seed=11)
    word, _ = make_arith_rows(num_train=100, num_test=1, digits=2, ops="+-", style="word", seed=12)
    rows = plain + word
    for i, row in enumerate(rows):
        row["extra_info"]["index"] = i
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    config = {"max_prompt_length": 512, "truncation": "error", "return_full_prompt": True}
    dataset = RLHFDataset(str(tmp_path / "train.parquet"), tokenizer, config)
    dataset.tokenizer = _NoTokenizer()
    for i in range(len(dataset)):
        assert_same_item(dataset[i], reference_item(rows[i], tokenizer, config), f"bundled tokenizer, item {i}")


def test_row_copy_is_deep_for_values_outside_plain_json():
    from verl.utils.dataset.rl_dataset import _copy_row

    inner = [1, 2]
    value = {"t": (inner, "x"), "a": np.array([3, 4]), "n": {"l": [{"k": 1.5}], "s": None}}
    copied = _copy_row(value)
    assert copied["n"] == value["n"] and copied["t"] == value["t"]
    assert np.array_equal(copied["a"], value["a"])
    inner.append(3)
    value["a"][0] = 9
    value["n"]["l"][0]["k"] = 0.0
    assert copied["t"][0] == [1, 2] and copied["a"].tolist() == [3, 4] and copied["n"]["l"][0]["k"] == 1.5
