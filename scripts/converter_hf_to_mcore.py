"""HF -> megatron dist checkpoint, with upstream verl's script name and arguments.

    python scripts/converter_hf_to_mcore.py --hf_model_path HF_DIR --output_path OUT_DIR

The same as `python -m verl.models.mcore.converter` (see there).
"""

from verl.models.mcore.converter import main

if __name__ == "__main__":
    main()
