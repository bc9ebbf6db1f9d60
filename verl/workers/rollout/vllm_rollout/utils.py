"""vLLM helpers that need no vLLM: engine arguments rendered as `vllm serve` flags.

`build_cli_args_from_config({"tensor-parallel-size": 2, "enforce-eager": True})` ->
`["--tensor-parallel-size", "2", "--enforce-eager"]`, upstream's rules for a server's argv:

- None and False are left out (the flag's default applies); True is the bare flag;
- a list or tuple (an OmegaConf ListConfig too) is the flag followed by one argument per item, and
  an empty one is left out, since vLLM's list flags take one or more values (`nargs="+"`);
- a mapping (a DictConfig too) is one JSON argument (`--compilation-config '{"level": 3}'`);
- anything else is `str(value)`.

Keys are used as given, in the mapping's order: vLLM's parser reads `max-model-len` and
`max_model_len` alike. verl's own rollout runs vLLM in-process (`vllm_rollout.vLLMRollout`), so
nothing here starts a server; this is for launching one from a config.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["build_cli_args_from_config"]


def _plain(value: Any) -> Any:
    """Mappings and sequences (OmegaConf containers included) as dicts and lists, for JSON."""
    if isinstance(value, Mapping):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return [_plain(item) for item in value]
    return value


def build_cli_args_from_config(config: Mapping[str, Any]) -> list[str]:
    """The command-line arguments for `config` (see the module docstring)."""
    args: list[str] = []
    for key, value in config.items():
        flag = f"--{key}"
        if value is None or value is False:
            continue
        if value is True:
            args.append(flag)
        elif isinstance(value, Mapping):
            args += [flag, json.dumps(_plain(value))]
        elif isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
            if len(value) > 0:
                args += [flag, *(str(item) for item in value)]
        else:
            args += [flag, str(value)]
    return args
