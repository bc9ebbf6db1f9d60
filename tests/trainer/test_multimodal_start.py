"""Start-up with images (docs/multimodal.md): the pre-flight checks of a run's files against its
policy (verl/trainer/preflight.py) and the TaskRunner's processor (`main_ppo.load_processor`), on the
real tiny-vl preset and real parquet files, before any worker starts."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import pytest

from verl.models import bundled_model_path
from verl.trainer.config import ConfigError, load_ppo_config
from verl.trainer.main_ppo import load_processor
from verl.trainer.preflight import RunInputError, check_run_inputs
from verl.utils.dataset.files import write_parquet


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory) -> str:
    from verl.models.factory import make_tiny

    return make_tiny("tiny-vl", str(tmp_path_factory.mktemp("tiny-vl")))


def _png() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (28, 28), (200, 0, 0)).save(buf, format="PNG")
    return buf.getvalue()


def write_rows(path: Path, rows: list[dict]) -> Path:
    write_parquet(rows, str(path))
    return path


def _rows(images: bool = True, videos: bool = False) -> list[dict]:
    rows = []
    for i in range(8):
        row = {
            "data_source": "colours",
            "prompt": [{"role": "user", "content": "<image>What colour is this?"}],
            "reward_model": {"style": "rule", "ground_truth": "red"},
            "extra_info": {"index": i},
        }
        rows.append(row)
        if images:
            row["images"] = [{"bytes": _png(), "path": None}]
        if videos:
            row["videos"] = [{"path": "clip.mp4"}]
    return rows


def _config(tmp_path: Path, model: str, data: Path):
    """The bundled demo config (CPU, built-in engine) on `data` with the policy `model`."""
    overrides = [
        f"actor_rollout_ref.model.path={model}",
        f"data.train_files={data}",
        f"data.val_files={data}",
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        f"trainer.default_local_dir={tmp_path / 'ckpt'}",
        f"trainer.run_dir={tmp_path / 'run'}",
    ]
    return load_ppo_config(overrides, config_name="arith_demo")


def _problems(config) -> list[str]:
    try:
        check_run_inputs(config)
    except RunInputError as e:
        return e.errors
    return []


def test_image_data_for_a_vision_language_policy_passes(tiny_vl, tmp_path):
    data = write_rows(tmp_path / "images.parquet", _rows())
    assert _problems(_config(tmp_path, tiny_vl, data)) == []


def test_videos_are_refused_for_a_vision_language_policy(tiny_vl, tmp_path):
    data = write_rows(tmp_path / "videos.parquet", _rows(videos=True))
    problems = _problems(_config(tmp_path, tiny_vl, data))
    assert len(problems) == 2, problems  # train and val files
    assert problems[0].startswith("data.train_files: ")
    assert "holds videos (column 'videos', data.video_key); videos are not supported here" in problems[0]
    # an empty videos column holds no videos
    rows = _rows()
    for row in rows:
        row["videos"] = []
    empty = write_rows(tmp_path / "no_videos.parquet", rows)
    assert _problems(_config(tmp_path, tiny_vl, empty)) == []


def test_images_are_refused_for_a_text_only_policy(tmp_path):
    data = write_rows(tmp_path / "images.parquet", _rows())
    problems = _problems(_config(tmp_path, bundled_model_path(), data))
    assert len(problems) == 2 and "holds images (column 'images', data.image_key)" in problems[0], problems
    assert "is a text-only model, which would never see them" in problems[0]
    # the same rows without images are the ordinary text case
    assert _problems(_config(tmp_path, bundled_model_path(), write_rows(tmp_path / "text.parquet", _rows(False)))) == []


def test_audio_is_refused_before_the_run_starts(tmp_path):
    rows = _rows(False)
    for row in rows:
        row["audios"] = [{"path": "clip.wav"}]
    problems = _problems(_config(tmp_path, bundled_model_path(), write_rows(tmp_path / "audio.parquet", rows)))
    assert len(problems) == 2 and "holds audio (column 'audios', data.audio_key)" in problems[0], problems


def test_a_vision_language_model_without_processor_files_is_refused(tiny_vl, tmp_path):
    bare = tmp_path / "bare-vl"
    shutil.copytree(tiny_vl, bare)
    for name in ("preprocessor_config.json", "processor_config.json"):
        (bare / name).unlink(missing_ok=True)
    data = write_rows(tmp_path / "images.parquet", _rows())
    config = _config(tmp_path, str(bare), data)
    problems = _problems(config)
    assert len(problems) == 1 and "is a vision-language model without processor files" in problems[0], problems
    with pytest.raises(RunInputError, match="holds no processor files"):
        load_processor(config)  # the TaskRunner's own check (for a hub id the driver cannot read)


def test_task_runner_loads_the_processor_of_a_vision_language_policy_only(tiny_vl, tmp_path):
    data = write_rows(tmp_path / "images.parquet", _rows())
    processor = load_processor(_config(tmp_path, tiny_vl, data))
    assert processor is not None and processor.image_token == "<|image_pad|>"
    text = write_rows(tmp_path / "text.parquet", _rows(False))
    assert load_processor(_config(tmp_path, bundled_model_path(), text)) is None


def test_task_runner_applies_the_vision_rules_to_the_loaded_config(tiny_vl, tmp_path):
    """What a hub id meets: the driver's check could not read its config.json, the TaskRunner can."""
    from omegaconf import OmegaConf

    data = write_rows(tmp_path / "images.parquet", _rows())
    config = _config(tmp_path, tiny_vl, data)
    OmegaConf.update(config, "actor_rollout_ref.rollout.name", "sglang")  # past the driver's check, as a hub id is
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref.rollout.name=sglang with the vision-language model"):
        load_processor(config)


@pytest.mark.slow  # main_ppo --cfg job in a subprocess: 4-12 s on the shared 2-core machine
def test_the_cpu_demo_script_passes_every_check(tiny_vl, tmp_path):
    """examples/grpo_trainer/run_tiny_vl_cpu.sh with `--cfg job` (Hydra's flag: print the config and run
    every check that needs no Ray), its model and data already in place (the script makes them with
    `verl.models.make_tiny` and examples/data_preprocess/vl_colors.py when they are missing)."""
    import os
    import subprocess
    import sys

    from verl.utils.dataset.vl_colors import write_vl_colors_parquet

    demo = tmp_path / "demo"
    shutil.copytree(tiny_vl, demo / "model")
    write_vl_colors_parquet(str(demo / "data"), num_train=32, num_test=8, answer_style="letter")
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root), PYTHON=sys.executable, VL_DEMO_DIR=str(demo))
    proc = subprocess.run(
        ["bash", "examples/grpo_trainer/run_tiny_vl_cpu.sh", "--cfg", "job"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "the config passed every check" in proc.stderr
    assert f"path: {demo / 'model'}" in proc.stdout
