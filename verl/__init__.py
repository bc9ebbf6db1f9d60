"""verl: a Ray single-controller framework for RL post-training of language models.

Importing the package is deliberately cheap: no ray, transformers or mlflow (not even torch) at
import time. `verl.DataProto` is resolved lazily on first attribute access.
"""

__version__ = "0.1.0"

__all__ = ["DataProto", "__version__"]


def __getattr__(name):
    if name == "DataProto":
        from verl.protocol import DataProto

        return DataProto
    raise AttributeError(f"module 'verl' has no attribute {name!r}")
