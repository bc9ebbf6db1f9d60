"""Preprocess AIME 2024 (BytedTsinghua-SIA/AIME-2024) for ReTool-style multi-turn validation with the
``code_interpreter`` tool.

    python examples/data_preprocess/aime2024_multiturn_w_tool.py --local_save_dir ~/data/retool_aime2024
    python examples/data_preprocess/aime2024_multiturn_w_tool.py --local_dataset_path /path/to/AIME-2024

The same conversion as ``dapo_multiturn_w_tool.py`` (rows kept, extra_info gains need_tools_kwargs and
tools_kwargs {code_interpreter: {create_kwargs: {ground_truth}}}); writes ``train.parquet``, which
upstream's ReTool scripts pass as data.val_files.
"""

from __future__ import annotations

from dapo_multiturn_w_tool import run

if __name__ == "__main__":
    run("BytedTsinghua-SIA/AIME-2024", "~/data/retool_aime2024", __doc__)
