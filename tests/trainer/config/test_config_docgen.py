"""docs/config_reference.md is generated from the schema and must be kept current."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from verl.trainer.config import docgen
from verl.trainer.config.validate import iter_schema_fields

ROOT = Path(__file__).resolve().parents[3]
DOC = ROOT / "docs" / "config_reference.md"


def test_committed_reference_is_current():
    assert DOC.read_text() == docgen.render(), (
        "docs/config_reference.md is stale; regenerate it with "
        "`python -m verl.trainer.config.docgen > docs/config_reference.md`"
    )


def documented_keys(text: str) -> set[str]:
    """Dotted keys as the page presents them: section headings plus the rows of their tables."""
    keys, section = set(), None
    for line in text.splitlines():
        m = re.match(r"^#+ `([\w.]+)`$", line)
        if m:
            section = m.group(1)
            keys.add(section)
        if line.startswith("## Top-level keys"):
            section = None  # the rows of this table are root keys (`model_engine`)
        m = re.match(r"^\| `(\w+)` \|", line)
        if m:
            keys.add(f"{section}.{m.group(1)}" if section else m.group(1))
    return keys


def test_reference_lists_every_key_with_type_default_and_status():
    text = docgen.render()
    assert documented_keys(text) == {key for key, _, _, _ in iter_schema_fields()}
    assert "| `train_batch_size` | int | `1024` | yes | Prompts per training step" in text
    assert "| `lora_rank` | int | `0` | yes | LoRA rank r of the critic" in text
    assert (
        "| `rank` | int | `0` | yes | LoRA rank of the critic; > 0 trains low-rank adapters" in text
    )  # the megatron critic's
    assert "| `path` | str | `~/models/deepseek-llm-7b-chat` |" in text
    assert "| `device` | str | `cuda` | yes; `npu`: no (Ascend NPUs) |" in text
    assert "| `loss_scale_factor` | float \\| null | `null` | yes |" in text
    assert (
        "| `lr_decay_style` | str | `constant` | yes | *megatron* " in text
    )  # a default only ppo_megatron_trainer has


def test_module_prints_the_reference():
    out = subprocess.run(
        [sys.executable, "-m", "verl.trainer.config.docgen"], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout
    assert out == docgen.render()
