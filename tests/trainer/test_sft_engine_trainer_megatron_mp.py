"""The engine SFT trainer (`verl.trainer.sft_trainer`) on the Megatron engine with model parallelism: per-step
losses at tensor, pipeline (also with two virtual stages) and context parallel size 2 (and expert parallel size 2 on the MoE preset) equal the
one-rank run's, and a checkpoint saved at tp=2 resumes at tp=1 (two data-parallel ranks) to the uninterrupted
run's next losses. Two gloo ranks, tiny presets, fp32."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.distributed_helpers import run_distributed
from verl.models.factory import make_tiny

STEPS = 3


@pytest.mark.parametrize(
    "sizes, world_size",
    [({"tensor_model_parallel_size": 2}, 1), ({"pipeline_model_parallel_size": 2, "context_parallel_size": 2}, 6)],
)
def test_a_split_the_ranks_cannot_hold_is_refused_naming_the_sizes(sizes, world_size):
    from omegaconf import OmegaConf

    from verl.trainer.sft_trainer import check_megatron_layout

    with pytest.raises(ValueError, match=rf"^{world_size} rank\(s\) cannot be split into engine.tensor_model") as e:
        check_megatron_layout(OmegaConf.create(sizes), world_size)
    assert "--nproc_per_node" in str(e.value) and "\n" not in str(e.value)
    check_megatron_layout(OmegaConf.create(sizes), 2 * world_size * 4)  # a multiple of the product passes


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    import pandas as pd

    from verl.utils.dataset.arith import write_arith_parquet

    root = tmp_path_factory.mktemp("sft_mcore_mp")
    train, test = write_arith_parquet(str(root / "arith"), num_train=48, num_test=8, seed=0)
    files = {}
    for name, src in (("train", train), ("test", test)):
        df = pd.read_parquet(src)
        rows = [
            {"messages": [*list(p), {"role": "assistant", "content": e["answer"]}]}
            for p, e in zip(df["prompt"], df["extra_info"])
        ]
        files[name] = str(root / f"{name}.parquet")
        pd.DataFrame(rows).to_parquet(files[name])
    return {"root": str(root), **files}


def _config(assets: dict, model: str, run_dir: str, *overrides: str):
    from omegaconf import OmegaConf

    from verl.trainer.config.loader import compose

    config = compose("sft_trainer_engine", group_overrides=["engine=megatron", "optim=megatron"])
    config.merge_with_dotlist(
        [
            f"data.train_files={assets['train']}",
            f"data.val_files={assets['test']}",
            "data.train_batch_size=8",
            "data.micro_batch_size_per_gpu=2",
            "data.use_dynamic_bsz=false",
            "data.max_length=32",
            f"model.path={model}",
            "engine.dtype=fp32",
            "optim.lr=3e-3",
            "optim.betas=[0.9,0.95]",
            "optim.weight_decay=0.01",
            f"trainer.total_training_steps={STEPS}",
            "trainer.test_freq=-1",
            f"trainer.default_local_dir={run_dir}",
            "trainer.device=cpu",
            "trainer.logger=[console]",
            *overrides,
        ]
    )
    OmegaConf.resolve(config)
    return config


def _train(assets, model, run_dir, *overrides) -> list[dict]:
    """One run in this process's group (megatron's layout from `overrides`); every rank's per-step metrics."""
    from verl.trainer.sft_trainer import build_trainer
    from verl.utils.megatron.parallel_state import destroy_model_parallel

    try:
        trainer = build_trainer(_config(assets, model, run_dir, *overrides))
        history = trainer.fit()
        for metrics in history:
            metrics["model_chunks"] = len(trainer.engine.chunks)
        return history
    finally:
        destroy_model_parallel()


def _losses(history: list[dict]) -> list[float]:
    return [m["train/loss"] for m in history]


def _layouts_rank(rank, world_size, assets, model, layouts, out):
    results = {}
    for name, overrides in layouts.items():
        history = _train(assets, model, f"{out}_{name}", "trainer.resume_mode=disable", *overrides)
        results[name] = {
            "losses": _losses(history),
            "grad_norms": [m["train/grad_norm"] for m in history],
            "val": history[-1]["val/loss"],
            "model_chunks": history[-1]["model_chunks"],
        }
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump(results, f)


def _read(out: str, world_size: int) -> list[dict]:
    results = []
    for rank in range(world_size):
        with open(f"{out}.{rank}.json") as f:
            results.append(json.load(f))
    return results


_REFERENCES: dict[str, tuple[str, dict]] = {}


def _one_rank_run(assets, preset: str) -> tuple[str, dict]:
    """(model directory, the one-rank run's results) for `preset`, computed once per module."""
    if preset not in _REFERENCES:
        model = make_tiny(preset, os.path.join(assets["root"], preset), seed=0)
        out = os.path.join(assets["root"], f"{preset}_one")
        run_distributed(_layouts_rank, 1, assets, model, {"one": []}, out)
        (results,) = _read(out, 1)
        _REFERENCES[preset] = model, results["one"]
    return _REFERENCES[preset]


def _check_layouts(assets, preset: str, layouts: dict[str, list[str]]) -> None:
    model, reference = _one_rank_run(assets, preset)
    expected = torch.tensor(reference["losses"], dtype=torch.float64)
    assert expected[-1] < expected[0]  # it learns: the comparison is not between two untrained models
    two = os.path.join(assets["root"], f"{preset}_{'_'.join(layouts)}")
    run_distributed(_layouts_rank, 2, assets, model, layouts, two)
    for rank, results in enumerate(_read(two, 2)):  # every rank logs the same numbers
        for name, result in results.items():
            torch.testing.assert_close(
                torch.tensor(result["losses"], dtype=torch.float64), expected, rtol=1e-5, atol=0, msg=f"{name} {rank}"
            )
            # Adam hides a gradient off by a constant factor from the losses; the norm does not
            torch.testing.assert_close(
                torch.tensor(result["grad_norms"], dtype=torch.float64),
                torch.tensor(reference["grad_norms"], dtype=torch.float64),
                rtol=1e-5,
                atol=0,
                msg=f"{name} {rank}",
            )
            assert result["val"] == pytest.approx(reference["val"], rel=1e-5), (name, rank)
            assert result["model_chunks"] == (2 if "vpp2" in name else 1), (name, rank)


@pytest.mark.slow
def test_losses_at_tp2_equal_the_one_rank_runs(assets):
    # engine.sequence_parallel is upstream's default true: the sequence is split over the two ranks too
    _check_layouts(assets, "tiny", {"tp2": ["engine.tensor_model_parallel_size=2"]})


@pytest.mark.slow
def test_losses_at_pp2_with_and_without_virtual_stages_equal_the_one_rank_runs(assets):
    _check_layouts(
        assets,
        "tiny",
        {
            "pp2": ["engine.pipeline_model_parallel_size=2"],
            "pp2_vpp2": ["engine.pipeline_model_parallel_size=2", "engine.virtual_pipeline_model_parallel_size=2"],
        },
    )


@pytest.mark.slow
def test_losses_at_cp2_equal_the_one_rank_runs(assets):
    _check_layouts(
        assets,
        "tiny",
        {
            "cp2": ["engine.context_parallel_size=2"],
            # token-budget micro-batches: a context-parallel rank holds half of each row, so twice the rows fit
            "cp2_dynamic": [
                "engine.context_parallel_size=2",
                "data.use_dynamic_bsz=true",
                "data.max_token_len_per_gpu=48",
            ],
        },
    )


@pytest.mark.slow
def test_losses_at_ep2_on_the_moe_preset_equal_the_one_rank_runs(assets):
    _check_layouts(assets, "tiny-moe", {"ep2": ["engine.expert_model_parallel_size=2"]})


def _resume_rank(rank, world_size, assets, model, out):
    saved_dir = os.path.join(assets["root"], "saved_tp2")
    whole = _train(
        assets,
        model,
        saved_dir,
        "engine.tensor_model_parallel_size=2",
        "trainer.save_freq=2",
        "trainer.resume_mode=disable",
    )
    resumed = _train(
        assets,
        model,
        os.path.join(assets["root"], "resumed_dp2"),
        "trainer.resume_mode=resume_path",
        f"trainer.resume_from_path={saved_dir}/global_step_2",
    )
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump({"whole": _losses(whole), "resumed": _losses(resumed)}, f)


@pytest.mark.slow
def test_a_checkpoint_saved_at_tp2_resumes_at_tp1_to_the_same_next_losses(assets):
    model = make_tiny("tiny", os.path.join(assets["root"], "tiny_resume"), seed=0)
    out = os.path.join(assets["root"], "resume")
    run_distributed(_resume_rank, 2, assets, model, out)
    for result in _read(out, 2):
        assert len(result["whole"]) == STEPS
        # the resumed run (tp=1: both ranks data-parallel) restarts at step 3 with the tp=2 run's weights,
        # Adam moments, lr schedule and data position
        assert len(result["resumed"]) == STEPS - 2
        assert result["resumed"][0] == pytest.approx(result["whole"][2], rel=1e-5)
        assert result["resumed"][0] != pytest.approx(result["whole"][0], rel=1e-3)
