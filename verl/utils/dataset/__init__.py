"""Datasets: `RLHFDataset` (RL prompts), `SFTDataset` (supervised pairs), `MultiTurnSFTDataset`
(supervised conversations), and the bundled tasks' generators. `from verl.utils.dataset import RLHFDataset` (upstream's import) resolves on first use,
so importing a generator (`verl.utils.dataset.arith`) does not import torch. Upstream's `RMDataset`
(pairwise reward-model training) is not implemented here."""

_LAZY = {
    "RLHFDataset": "verl.utils.dataset.rl_dataset",
    "SFTDataset": "verl.utils.dataset.sft_dataset",
    "MultiTurnSFTDataset": "verl.utils.dataset.multiturn_sft_dataset",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["MultiTurnSFTDataset", "RLHFDataset", "SFTDataset"]
