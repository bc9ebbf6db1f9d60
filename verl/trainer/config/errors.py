"""Config error types and the did-you-mean helper shared by the loader and the validator."""

from __future__ import annotations

import difflib


class ConfigError(ValueError):
    """A config the user can fix: the message says what is wrong, why, and what to do.

    `errors` holds every problem found (the validator reports them all at once).
    """

    def __init__(self, message: str, errors: list[str] | None = None):
        super().__init__(message)
        self.errors = errors if errors is not None else [message]


class ConfigWarning(UserWarning):
    """A config that runs but is probably not what the user meant."""


def did_you_mean(
    name: str, siblings: list[str], *, prefix: str = "", all_keys: list[str] | None = None, full_key: str = ""
) -> str:
    """' Did you mean X?' for a misspelled key, or '' when nothing is close.

    Looks first among keys of the same section (`siblings`), then among every dotted key of the
    config (`all_keys`), matching either the whole dotted key or its last component, so that
    `actor_rollout_ref.actor.lr` suggests `actor_rollout_ref.actor.optim.lr`.
    """
    close = difflib.get_close_matches(name, siblings, n=1, cutoff=0.6)
    if not close and len(name) >= 3:  # a truncated name: `n_gpus` for `n_gpus_per_node`
        close = [s for s in siblings if s.startswith(name) or name.startswith(s)][:1]
    if close:
        return f" Did you mean {prefix}{close[0]}?"
    if not all_keys:
        return ""
    ancestors = {full_key.rsplit(".", i)[0] for i in range(1, full_key.count(".") + 1)}
    candidates = [k for k in all_keys if k not in ancestors]
    # The right key in another section (`actor.lr` -> `actor.optim.lr`): same last component.
    same_leaf = [k for k in candidates if k.rsplit(".", 1)[-1] == name]
    if same_leaf:
        return f" Did you mean {_closest(full_key, same_leaf)}?"
    whole = difflib.get_close_matches(full_key, candidates, n=1, cutoff=0.8)
    if whole:
        return f" Did you mean {whole[0]}?"
    leaves = sorted({k.rsplit(".", 1)[-1] for k in candidates})
    leaf = difflib.get_close_matches(name, leaves, n=1, cutoff=0.8)
    if leaf:
        return f" Did you mean {_closest(full_key, [k for k in candidates if k.rsplit('.', 1)[-1] == leaf[0]])}?"
    return ""


def _closest(target: str, options: list[str]) -> str:
    return max(options, key=lambda o: difflib.SequenceMatcher(None, target, o).ratio())
