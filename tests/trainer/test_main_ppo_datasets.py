"""The PPO entry point builds its datasets from the config's upstream keys: `data.custom_cls`
swaps in a user Dataset class and `data.train_max_samples` / `data.val_max_samples` cap the rows."""

from __future__ import annotations

from verl.models import bundled_model_path
from verl.trainer.config import load_ppo_config
from verl.trainer.main_ppo import build_datasets
from verl.utils.dataset.arith import ensure_arith_data
from verl.utils.dataset.rl_dataset import RLHFDataset
from verl.utils.tokenizer import hf_tokenizer


def test_custom_dataset_class_and_row_caps_reach_the_trainer(tmp_path):
    train_file, test_file = ensure_arith_data(str(tmp_path / "arith"))
    module = tmp_path / "tagged_dataset.py"
    module.write_text(
        "from verl.utils.dataset.rl_dataset import RLHFDataset\n"
        "class Tagged(RLHFDataset):\n"
        "    def __getitem__(self, i):\n"
        "        row = super().__getitem__(i)\n"
        "        row['tag'] = 'mine'\n"
        "        return row\n"
    )
    cfg = load_ppo_config(
        [
            f"data.train_files={train_file}",
            f"data.val_files={test_file}",
            f"data.custom_cls.path={module}",
            "data.custom_cls.name=Tagged",
            "data.train_max_samples=5",
            "data.val_max_samples=3",
        ],
        config_name="arith_demo",
    )
    train, val = build_datasets(cfg, hf_tokenizer(bundled_model_path()))
    assert type(train).__name__ == type(val).__name__ == "Tagged" and isinstance(train, RLHFDataset)
    assert (len(train), len(val)) == (5, 3)
    assert train[0]["tag"] == "mine"


def test_without_val_files_there_is_no_validation_set(tmp_path):
    train_file, _ = ensure_arith_data(str(tmp_path / "arith"))
    cfg = load_ppo_config(
        [f"data.train_files={train_file}", "data.val_files=[]", "trainer.test_freq=-1"], config_name="arith_demo"
    )
    train, val = build_datasets(cfg, hf_tokenizer(bundled_model_path()))
    assert val is None and type(train) is RLHFDataset and len(train) > 0
