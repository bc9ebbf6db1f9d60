"""`python -m verl.model_merger {merge,test} --backend {fsdp,megatron} --local_dir DIR ...` (see the package docstring)."""

from __future__ import annotations

import sys

from verl.model_merger.base_model_merger import ModelMergerConfig, ModelMergerError


def get_merger(config: ModelMergerConfig):
    """The merger for `config.backend`."""
    if config.backend == "fsdp":
        from verl.model_merger.fsdp_model_merger import FSDPModelMerger

        return FSDPModelMerger(config)
    if config.backend == "megatron":
        from verl.model_merger.megatron_model_merger import MegatronModelMerger

        return MegatronModelMerger(config)
    raise ModelMergerError(f"unknown backend {config.backend!r}; use fsdp or megatron")


def main(argv: list[str] | None = None) -> None:
    from verl.model_merger.base_model_merger import generate_config_from_args, parse_args

    args = parse_args(argv)
    try:
        get_merger(generate_config_from_args(args)).run()
    except (ModelMergerError, NotImplementedError) as e:
        print(f"verl.model_merger: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
