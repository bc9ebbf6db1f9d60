"""Interactions from upstream's YAML: `interaction: [{name, class_name, config}, ...]`.

`name` defaults to the class name, lower-cased, without an `Interaction` suffix (upstream's rule);
samples pick theirs with `extra_info.interaction_kwargs.name`. An empty list gives no interactions
(as upstream); a file without the `interaction` key is an error.
"""

from __future__ import annotations

import importlib

from omegaconf import OmegaConf

from verl.interactions.base import BaseInteraction


def get_interaction_class(class_name: str) -> type[BaseInteraction]:
    module_name, _, attr = class_name.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise type(e)(  # the same exception type as upstream's plain import
            f"interaction class_name {class_name!r} cannot be imported ({e}); give the full import path of a "
            "BaseInteraction subclass, e.g. verl.interactions.gsm8k_interaction.Gsm8kInteraction"
        ) from e
    return cls


def initialize_interactions_from_config(path: str) -> dict[str, BaseInteraction]:
    """{name: interaction instance} from the YAML at `path`."""
    entries = OmegaConf.load(path).get("interaction")
    if entries is None:
        raise ValueError(
            f"interaction config {path!r} has no `interaction:` list; write "
            "`interaction: [{name: ..., class_name: ..., config: {}}]`"
        )
    interactions: dict[str, BaseInteraction] = {}
    for entry in entries:
        class_name = entry.class_name
        name = entry.get("name")
        if name is None:
            simple = class_name.rsplit(".", 1)[-1]
            name = (simple[: -len("Interaction")] if simple.endswith("Interaction") else simple).lower()
        if name in interactions:
            raise ValueError(
                f"Duplicate interaction name {name!r} found in interaction config {path!r}; each interaction needs "
                "its own name (set `name:` on one of them)"
            )
        config = OmegaConf.to_container(entry.get("config") or OmegaConf.create({}), resolve=True)
        config["name"] = name
        interactions[name] = get_interaction_class(class_name)(config=config)
    return interactions
