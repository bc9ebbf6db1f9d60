"""scripts/print_cfg.py: upstream's script name and command line; prints the composed config and the
critic's profiler section built into its class."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "print_cfg.py"


def _run(tmp_path, *overrides):
    # from another directory: the script finds its repository's configs and code itself
    return subprocess.run(
        [sys.executable, str(SCRIPT), *overrides], capture_output=True, text=True, cwd=tmp_path, timeout=300
    )


def test_prints_the_composed_config_with_overrides_and_the_critic_profiler_section(tmp_path):
    result = _run(tmp_path, "critic.profiler.enable=true", "critic.profiler.ranks=[0,3]", "data.train_batch_size=24")
    assert result.returncode == 0, result.stderr
    config_line, profiler_line = result.stdout.strip().splitlines()[-2:]
    assert "'train_batch_size': 24" in config_line and "'critic':" in config_line
    assert profiler_line.startswith("ProfilerConfig(") and "enable=True" in profiler_line
    assert "ranks=[0, 3]" in profiler_line


def test_an_unknown_override_fails_with_hydras_message(tmp_path):
    result = _run(tmp_path, "critic.profiler.no_such_key=1")
    assert result.returncode != 0
    assert "no_such_key" in result.stderr
