"""The code in docs/howto.md runs: every fenced Python block whose first line is `# <name>.py` is
written to that file and used the way the page says (reward function, data file, dataset class)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from verl.models import bundled_model_path
from verl.trainer.config import load_ppo_config
from verl.trainer.main_ppo import build_datasets
from verl.trainer.ppo.reward import get_custom_reward_fn, load_reward_manager
from verl.utils.tokenizer import hf_tokenizer

HOWTO = Path(__file__).resolve().parents[2] / "docs" / "howto.md"


@pytest.fixture(scope="module")
def examples(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("howto")
    blocks = re.findall(r"```python\n# (\w+\.py)\n(.*?)```", HOWTO.read_text(), flags=re.S)
    assert {name for name, _ in blocks} >= {"my_reward.py", "make_data.py", "my_dataset.py"}
    for name, body in blocks:
        (out / name).write_text(body)
    return out


def test_the_reward_function_example_scores_the_last_word(examples):
    cfg = load_ppo_config(
        [f"custom_reward_function.path={examples / 'my_reward.py'}", "custom_reward_function.name=compute_score"],
        config_name="arith_demo",
    )
    fn = get_custom_reward_fn(cfg)
    assert fn("reverse_words", "e d c", "e d c") == {"score": 0.0, "num_words": 3}  # last word "c" != "e d c"
    assert fn("x", "the answer is 42", 42) == {"score": 1.0, "num_words": 4}
    assert fn("x", "   ", "42") == {"score": 0.0, "num_words": 0}
    load_reward_manager(cfg, hf_tokenizer(bundled_model_path()), num_examine=0)  # the trainer accepts it


def test_the_data_and_dataset_class_examples_reach_the_trainer(examples):
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_data", examples / "make_data.py")
    make_data = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_data)
    make_data.write(str(examples / "data"))
    cfg = load_ppo_config(
        [
            f"data.train_files={examples / 'data' / 'train.parquet'}",
            f"data.val_files={examples / 'data' / 'test.parquet'}",
            "data.max_prompt_length=64",
            f"data.custom_cls.path={examples / 'my_dataset.py'}",
            "data.custom_cls.name=ShoutingDataset",
        ],
        config_name="arith_demo",
    )
    tokenizer = hf_tokenizer(bundled_model_path())
    train, val = build_datasets(cfg, tokenizer)
    assert (len(train), len(val)) == (12, 2)
    text = tokenizer.decode(train[1]["input_ids"], skip_special_tokens=True)
    assert "REVERSE THE WORDS: C D E" in text
    assert train[1]["reward_model"]["ground_truth"] == "e d c"
