"""Write a randomly initialised copy of a Hugging Face model with some config values changed: a small
model of a real architecture (and its real tokenizer) for debugging runs and end-to-end tests.

    python scripts/init_random_model.py --hf_model_path DIR --new_config_path NEW.json --output_path OUT

Upstream verl's command line. NEW.json holds the config.json keys to change (e.g. fewer layers, a smaller
hidden size); the model type cannot change. When OUT already exists nothing is written (a warning says
so), so a launch script can call this before every run. OUT appears only once everything is written:
a failed run leaves no half-written directory behind that a rerun would then skip.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import warnings


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf_model_path", required=True, help="Hugging Face model directory to take the config from")
    parser.add_argument("--new_config_path", required=True, help="JSON file of the config keys to change")
    parser.add_argument("--output_path", required=True, help="directory to write the random model to")
    parser.add_argument(
        "--trust_remote_code", action="store_true", help="allow the model directory's own Python code (off by default)"
    )
    parser.add_argument("--seed", type=int, default=None, help="weight initialisation seed (default: unseeded)")
    return parser.parse_args(argv)


def merged_config_dict(original: dict, changes: dict) -> dict:
    """`original` updated with `changes`; refuses a different model type, warns on keys `original` lacks."""
    new_type = changes.get("model_type")
    if new_type is not None and new_type != original.get("model_type"):
        raise ValueError(
            f"the new config's model_type {new_type!r} differs from the model's {original.get('model_type')!r}; "
            "this script changes sizes within one architecture: drop model_type from the new config or start "
            "from a model of that type"
        )
    for key in changes:
        if key not in original:
            warnings.warn(
                f"config key {key!r} is not in the model's config.json; the model class may ignore it", stacklevel=2
            )
    merged = {**original, **changes}
    layers = merged.get("num_hidden_layers")
    if "layer_types" in original and "layer_types" not in changes and len(original["layer_types"]) != layers:
        # a per-layer list sized for the old depth: let the config class rebuild it for the new one
        kinds = set(original["layer_types"])
        if len(kinds) != 1:
            raise ValueError(
                f"num_hidden_layers changes to {layers} but the model's layer_types mixes {sorted(kinds)}; "
                "give layer_types for the new depth in the new config"
            )
        merged["layer_types"] = [kinds.pop()] * layers
    return merged


def init_random_model(
    hf_model_path: str,
    new_config_path: str,
    output_path: str,
    trust_remote_code: bool = False,
    seed: int | None = None,
) -> str:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig

    for path, what in ((hf_model_path, "--hf_model_path"), (new_config_path, "--new_config_path")):
        if not os.path.exists(path):
            raise FileNotFoundError(f"{what} {path!r} does not exist (cwd: {os.getcwd()})")
    with open(new_config_path) as f:
        try:
            changes = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"--new_config_path {new_config_path!r} is not valid JSON: {e}") from e
    if not isinstance(changes, dict):
        raise ValueError(f"--new_config_path {new_config_path!r} must hold a JSON object of config keys")

    original, _ = PretrainedConfig.get_config_dict(hf_model_path)
    merged = merged_config_dict(original, changes)
    config_class = type(AutoConfig.from_pretrained(hf_model_path, trust_remote_code=trust_remote_code))
    config = config_class.from_dict(merged)
    tokenizer = AutoTokenizer.from_pretrained(hf_model_path, trust_remote_code=trust_remote_code)
    if seed is not None:
        torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)

    parent = os.path.dirname(os.path.abspath(output_path))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".init_random_model.", dir=parent)
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        config.save_pretrained(staging)
        os.rename(staging, output_path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    n_params = sum(p.numel() for p in model.parameters())
    print(f"random {config.model_type} model ({n_params:,} parameters) written to {output_path}")
    return output_path


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if os.path.exists(args.output_path):
        warnings.warn(f"output path {args.output_path!r} already exists; nothing written", stacklevel=1)
        return 0
    try:
        init_random_model(
            args.hf_model_path, args.new_config_path, args.output_path, args.trust_remote_code, seed=args.seed
        )
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
