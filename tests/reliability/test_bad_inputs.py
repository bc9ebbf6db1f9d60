"""Bad inputs stop `python -m verl.trainer.main_ppo` before Ray starts: exit status 2 within seconds, a
message that says what is wrong, why and what to do, and an earlier run's checkpoints left untouched.

Each case runs `main()` in this process with Ray's start-up replaced by a failure, so a check that
stopped working shows up as "reached Ray" instead of a minute-long training run. One case runs the
real command line in a subprocess to pin the exit status and the time end to end. Failures that
need a running trainer (rewards, NaN losses) are in test_trainer_failures.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from reliability_helpers import (
    DEMO,
    ROOT,
    arith_rows,
    fake_checkpoint,
    fingerprint,
    model_path,
    run_env,
    small_run,
    write_rows,
)

from verl.trainer.main_ppo import main


@pytest.fixture
def run(tmp_path, monkeypatch, capsys):
    """run(*overrides) -> (exit status, stderr) of main(), with an earlier run's checkpoint in place
    that must survive, and Ray's start-up made to fail loudly."""
    import ray

    def no_ray(*args, **kwargs):
        raise AssertionError("reached Ray: the bad input was not caught before start-up")

    monkeypatch.setattr(ray, "init", no_ray)
    monkeypatch.setenv("VERL_CACHE_DIR", str(tmp_path / "cache"))
    ckpt = fake_checkpoint(tmp_path / "ckpt")
    before = fingerprint(ckpt)
    good = write_rows(tmp_path / "good.parquet", arith_rows(16))
    base = [DEMO, *small_run(tmp_path), f"data.train_files={good}", f"data.val_files={good}"]

    def _run(*overrides: str) -> tuple[int, str]:
        start = time.monotonic()
        with pytest.raises(SystemExit) as exit_info:
            main([*base, *overrides])
        elapsed = time.monotonic() - start
        assert elapsed < 60, f"took {elapsed:.1f} s"
        assert fingerprint(ckpt) == before, "the failed run touched the existing checkpoints"
        return exit_info.value.code, capsys.readouterr().err

    return _run


def _expect(result: tuple[int, str], *parts: str) -> str:
    code, err = result
    assert code == 2, err
    for part in parts:
        assert part in err, f"{part!r} missing from:\n{err}"
    return err


# ------------------------------------------------------------------------------------------ data


def test_missing_data_file_names_the_file_and_how_to_create_it(run, tmp_path):
    _expect(
        run(f"data.train_files={tmp_path / 'nope.parquet'}"),
        "verl: cannot start",
        "data.train_files: data file",
        "nope.parquet' does not exist",
        "examples/data_preprocess/",
    )


def test_parquet_without_prompt_column_lists_the_columns_it_has(run, tmp_path):
    rows = [{k: v for k, v in r.items() if k != "prompt"} for r in arith_rows(8)]
    bad = write_rows(tmp_path / "no_prompt.parquet", rows)
    err = _expect(run(f"data.train_files={bad}"), "has no column 'prompt'", "data.prompt_key")
    assert "['ability', 'data_source', 'extra_info', 'reward_model']" in err


def test_parquet_without_reward_model_column_says_what_the_column_is_for(run, tmp_path):
    rows = [{k: v for k, v in r.items() if k != "reward_model"} for r in arith_rows(8)]
    bad = write_rows(tmp_path / "no_reward.parquet", rows)
    _expect(run(f"data.val_files={bad}"), "data.val_files", "has no column 'reward_model'", "ground_truth")


def test_reward_model_column_without_ground_truth_is_rejected(run, tmp_path):
    rows = [{**r, "reward_model": {"style": "rule"}} for r in arith_rows(8)]
    bad = write_rows(tmp_path / "no_truth.parquet", rows)
    _expect(run(f"data.train_files={bad}"), "column 'reward_model' has the fields ['style'] but no 'ground_truth'")


def test_empty_dataset_is_rejected(run, tmp_path):
    import pyarrow.parquet as pq

    good = pq.read_table(tmp_path / "good.parquet")
    empty = tmp_path / "empty.parquet"
    pq.write_table(good.slice(0, 0), empty)
    _expect(run(f"data.train_files={empty}"), "empty.parquet' has no rows", "nothing to train")


def test_training_set_smaller_than_one_batch_is_rejected(run, tmp_path):
    few = write_rows(tmp_path / "few.parquet", arith_rows(3))
    _expect(run(f"data.train_files={few}"), "has 3 prompts, fewer than one batch of data.train_batch_size=4")


# ----------------------------------------------------------------------------------------- models


def test_model_path_that_does_not_exist(run, tmp_path):
    _expect(
        run(f"actor_rollout_ref.model.path={tmp_path / 'no_model'}"),
        "actor_rollout_ref.model.path=",
        "no_model does not exist",
        "Hugging Face model directory",
    )


def test_model_path_that_is_not_a_causal_lm(run, tmp_path):
    import json
    import shutil

    classifier = tmp_path / "reward_model"
    shutil.copytree(model_path(), classifier)
    config = json.loads((classifier / "config.json").read_text())
    config["architectures"] = ["Qwen2ForSequenceClassification"]
    (classifier / "config.json").write_text(json.dumps(config))
    _expect(
        run(f"actor_rollout_ref.model.path={classifier}"),
        "holds a Qwen2ForSequenceClassification",
        "not a causal language model",
        "ForCausalLM",
    )


def test_model_path_that_is_not_a_model_directory(run, tmp_path):
    (tmp_path / "weights_only").mkdir()
    (tmp_path / "weights_only" / "model.safetensors").write_bytes(b"")
    _expect(
        run(f"actor_rollout_ref.model.path={tmp_path / 'weights_only'}"),
        "a directory without a config.json (it holds model.safetensors)",
        "not a Hugging Face model directory",
    )


def test_hf_config_path_is_checked_in_place_of_the_model_path_s_config(run, tmp_path):
    # the config directory's config.json is the policy's: path's own is not read, its is
    (tmp_path / "config_only").mkdir()
    _expect(
        run(f"actor_rollout_ref.model.hf_config_path={tmp_path / 'config_only'}"),
        "actor_rollout_ref.model.hf_config_path=",
        "a directory without a config.json (it holds nothing)",
    )
    _expect(
        run(
            f"actor_rollout_ref.model.path={tmp_path / 'no_weights'}",
            f"actor_rollout_ref.model.hf_config_path={model_path()}",
        ),
        "no_weights is not a directory; point it at the directory that holds the weights",
    )


# ----------------------------------------------------------------------------------------- config


def test_misspelled_key_suggests_the_right_one(run):
    code, err = run("data.train_batch_sze=8")
    assert code == 2 and "verl: invalid configuration" in err
    assert "Did you mean data.train_batch_size?" in err


def test_batch_that_does_not_divide_over_the_workers_gives_a_valid_value(run):
    _expect(
        run(
            "data.train_batch_size=5", "actor_rollout_ref.actor.ppo_mini_batch_size=5", "actor_rollout_ref.rollout.n=3"
        ),
        "5 x 3 = 15 sequences per step is not divisible by the 2 workers",
        "set data.train_batch_size=6",
    )


def test_upstream_choices_not_implemented_here_are_config_errors(run):
    _expect(
        run("actor_rollout_ref.hybrid_engine=false"),
        "actor_rollout_ref.hybrid_engine=false is not implemented in this verl",
        "would silently train something else",
    )


def test_megatron_layout_that_does_not_divide_the_ranks(run):
    _expect(
        run("--config-name=arith_demo_megatron", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=3"),
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=3 x pipeline_model_parallel_size=1 x "
        "context_parallel_size=1 = 3 ranks",
        "does not divide the 2 ranks",
    )


# --------------------------------------------------------------------------------- reward function


def test_custom_reward_file_that_is_missing(run, tmp_path):
    _expect(
        run(f"custom_reward_function.path={tmp_path / 'my_reward.py'}"),
        "custom_reward_function.path=",
        "my_reward.py' does not exist",
    )


def test_custom_reward_function_name_not_in_the_file_lists_its_functions(run, tmp_path):
    reward = tmp_path / "my_reward.py"
    reward.write_text(
        "import math\n\ndef score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n"
    )
    _expect(
        run(f"custom_reward_function.path={reward}", "custom_reward_function.name=compute_score"),
        "custom_reward_function.name='compute_score' is not defined",
        "defines the functions ['score']",
    )


def test_custom_reward_file_with_a_syntax_error(run, tmp_path):
    reward = tmp_path / "my_reward.py"
    reward.write_text("def compute_score(:\n    pass\n")
    _expect(run(f"custom_reward_function.path={reward}"), "is not valid Python (line 1")


# ------------------------------------------------------------------------------------ checkpoints


def test_checkpoint_directory_under_a_file_is_not_writable(run, tmp_path):
    (tmp_path / "a_file").write_text("")
    _expect(
        run("trainer.save_freq=1", f"trainer.default_local_dir={tmp_path / 'a_file' / 'ckpt'}"),
        "trainer.default_local_dir=",
        "is not writable",
        "is a file, not a directory",
        "trainer.save_freq=-1",
    )


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_checkpoint_directory_without_write_permission(run, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        _expect(
            run("trainer.save_freq=1", f"trainer.default_local_dir={locked / 'ckpt'}"),
            "is not writable",
            "Permission denied",
        )
    finally:
        locked.chmod(0o755)


@pytest.mark.skipif(os.geteuid() != 0, reason="covered by the test above when not root")
def test_checkpoint_directory_without_write_permission_as_a_dropped_root(tmp_path):
    """Root writes anywhere, so the test above cannot deny it; here the same check runs in a child
    that drops to the unprivileged `nobody` user, against a real read-only directory."""
    import multiprocessing
    import tempfile

    from verl.trainer import preflight

    base = tempfile.mkdtemp(prefix="verl-locked-")  # pytest's tmp_path is private to root (0700)
    os.chmod(base, 0o755)
    locked = os.path.join(base, "locked")
    os.mkdir(locked, 0o555)
    os.chmod(locked, 0o555)

    def check(queue):
        os.setgid(65534)
        os.setuid(65534)
        queue.put(preflight._unwritable_reason(os.path.join(locked, "ckpt")))

    queue = multiprocessing.get_context("fork").Queue()
    child = multiprocessing.get_context("fork").Process(target=check, args=(queue,))
    child.start()
    reason = queue.get(timeout=30)
    child.join(30)
    os.chmod(locked, 0o755)
    os.rmdir(locked)
    os.rmdir(base)
    assert reason == f"cannot create files in {locked}: Permission denied"
    assert preflight._unwritable_reason(os.path.join(locked + "-gone", "ckpt")) is None  # root, writable parent


def test_resume_from_path_without_global_step(run, tmp_path):
    _expect(
        run("trainer.resume_mode=resume_path", f"trainer.resume_from_path={tmp_path / 'ckpt'}"),
        "does not name a checkpoint",
        "global_step_N",
        "trainer.resume_mode=auto",
    )


def test_resume_from_a_step_directory_that_does_not_exist(run, tmp_path):
    _expect(
        run("trainer.resume_mode=resume_path", f"trainer.resume_from_path={tmp_path / 'ckpt' / 'global_step_7'}"),
        "global_step_7 does not exist",
    )


def test_resume_from_an_interrupted_save_is_refused(run, tmp_path):
    (tmp_path / "ckpt" / "global_step_2" / "actor").mkdir(parents=True)
    _expect(
        run("trainer.resume_mode=resume_path", f"trainer.resume_from_path={tmp_path / 'ckpt' / 'global_step_2'}"),
        "is not a complete checkpoint (it has no data.pt",
        "latest_checkpointed_iteration.txt",
    )


def test_tracker_naming_a_missing_step_does_not_silently_start_from_scratch(tmp_path, monkeypatch, capsys):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "latest_checkpointed_iteration.txt").write_text("5")
    monkeypatch.setenv("VERL_CACHE_DIR", str(tmp_path / "cache"))
    good = write_rows(tmp_path / "good.parquet", arith_rows(8))
    with pytest.raises(SystemExit) as exit_info:
        main([DEMO, *small_run(tmp_path), f"data.train_files={good}", f"data.val_files={good}"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert "names step 5, but" in err and "silently start from scratch" in err


# ---------------------------------------------------------------------------------- the real CLI


def test_command_line_exits_2_within_seconds_without_starting_ray(tmp_path):
    ckpt = fake_checkpoint(tmp_path / "ckpt")
    before = fingerprint(ckpt)
    start = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "verl.trainer.main_ppo",
            DEMO,
            *small_run(tmp_path),
            f"data.train_files={tmp_path / 'x.parquet'}",
        ],
        cwd=ROOT,
        env=run_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    elapsed = time.monotonic() - start
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert elapsed < 60
    assert proc.stderr.startswith("verl: cannot start: data.train_files: data file"), proc.stderr[-3000:]
    assert "x.parquet' does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr and "Started a local Ray instance" not in proc.stderr + proc.stdout
    assert fingerprint(ckpt) == before
