"""Speed paths: merged over processes, logged once, recorded as metrics and in the run directory."""

from __future__ import annotations

import logging

import yaml

from verl.utils import speed_paths
from verl.utils.speed_paths import SpeedPath


def test_merge_is_on_only_where_every_requesting_process_is_on():
    merged = speed_paths.merge(
        [
            SpeedPath("shared_prompt_forward", True, True),
            SpeedPath("remove_padding", False, False),
            SpeedPath("shared_prompt_forward", True, False, "gradient checkpointing"),
            SpeedPath("remove_padding", True, True),
            SpeedPath("shared_prompt_forward", True, False, "gradient checkpointing"),
            SpeedPath("cuda_graphs", False, False),
        ]
    )
    assert merged == [
        SpeedPath("shared_prompt_forward", True, False, "gradient checkpointing"),
        SpeedPath("remove_padding", True, True),
        SpeedPath("cuda_graphs", False, False),
    ]


def test_metrics_are_one_for_on_and_zero_for_off():
    paths = [SpeedPath("shared_prompt_forward", True, True), SpeedPath("cuda_graphs", True, False, "CPU")]
    assert speed_paths.metrics(paths) == {"perf/shared_prompt_forward": 1.0, "perf/cuda_graphs": 0.0}


def test_report_warns_once_for_a_requested_path_that_is_off(caplog):
    log = logging.getLogger("test_speed_paths")
    off = SpeedPath("fused_kernels_test", True, False, "not implemented")
    on = SpeedPath("remove_padding_test", True, True)
    with caplog.at_level(logging.INFO, logger="test_speed_paths"):
        speed_paths.report([off, on], log)
        speed_paths.report([off, on], log)
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.WARNING, "speed path fused_kernels_test: OFF although requested: not implemented"),
        (logging.INFO, "speed path remove_padding_test: on"),
    ]


def test_save_writes_every_path_to_the_run_directory(tmp_path):
    paths = [SpeedPath("shared_prompt_forward", True, True), SpeedPath("cuda_graphs", True, False, "CPU")]
    written = speed_paths.save(paths, tmp_path / "run")
    assert written == tmp_path / "run" / speed_paths.SPEED_PATHS_FILE
    assert yaml.safe_load(written.read_text()) == {
        "shared_prompt_forward": {"requested": True, "active": True, "reason": ""},
        "cuda_graphs": {"requested": True, "active": False, "reason": "CPU"},
    }


def test_a_path_dict_round_trips():
    path = SpeedPath("shm_transport", True, False, "no /dev/shm")
    assert SpeedPath.from_dict(path.to_dict()) == path


def test_describe_says_on_off_or_off_although_requested():
    assert SpeedPath("cuda_graphs", False, False).describe() == "cuda_graphs: off (not requested)"
    assert SpeedPath("shm_transport", False, False, "VERL_SHM_TRANSPORT=0 turns it off").describe() == (
        "shm_transport: off (not requested: VERL_SHM_TRANSPORT=0 turns it off)"
    )
    assert SpeedPath("remove_padding", True, True).describe() == "remove_padding: on"
