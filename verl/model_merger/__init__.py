"""Turn a training checkpoint into a plain Hugging Face model directory.

    python -m verl.model_merger merge --backend fsdp \\   # or --backend megatron
        --local_dir checkpoints/PROJECT/EXPERIMENT/global_step_100/actor --target_dir ./merged
    python -m verl.model_merger test --backend fsdp --local_dir ... --test_hf_dir REFERENCE_HF_DIR

`merge` writes config.json, model.safetensors (sharded when large), the tokenizer files and
generation_config.json, loadable with `AutoModelForCausalLM.from_pretrained` (or
`AutoModelForTokenClassification` for a critic; `AutoModelForImageTextToText`, with the processor
files, for a vision-language model). `test` compares the checkpoint's weights with a
reference HF directory instead of writing anything.

Importing this package is cheap; torch and transformers are imported by the submodules.
"""

from __future__ import annotations

__all__ = ["main"]


def main(argv: list[str] | None = None) -> None:
    """The `python -m verl.model_merger` command line (see `verl/model_merger/__main__.py`)."""
    from verl.model_merger.__main__ import main as _main

    _main(argv)
