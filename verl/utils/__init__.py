"""Utilities shared by every layer. Upstream's convenience exports (`hf_tokenizer`, `hf_processor`,
`as_torch_index`, `group_mean_std`,
`omega_conf_to_dataclass`) are resolved on first access, so `import verl.utils` stays
free of torch and transformers."""

_LAZY_EXPORTS = {
    "hf_tokenizer": "verl.utils.tokenizer",
    "hf_processor": "verl.utils.tokenizer",
    "as_torch_index": "verl.utils.groupwise",
    "group_mean_std": "verl.utils.groupwise",
    "omega_conf_to_dataclass": "verl.utils.config",
}

__all__ = sorted(_LAZY_EXPORTS)


def __getattr__(name):
    module = _LAZY_EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'verl.utils' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
