"""FSDP2 SFT trainer: exact loss/gradient normalisation in-process, then a real 2-process torchrun
run on CPU whose loss falls, which checkpoints, exports HF weights and resumes where it stopped."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.distributed_helpers import free_port
from verl.models.factory import make_tiny
from verl.utils.dataset.arith import write_arith_parquet

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(REPO_ROOT, "verl", "trainer", "config", "sft_trainer.yaml")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    model_dir = make_tiny("tiny", str(root / "model"), seed=0)
    train_path, test_path = write_arith_parquet(str(root / "data"), num_train=256, num_test=32, seed=0)
    return {"root": root, "model": model_dir, "train": train_path, "test": test_path}


def _config(assets, *overrides):
    from verl.trainer.fsdp_sft_config import sft_config

    return sft_config(
        [
            f"data.train_files={assets['train']}",
            f"data.val_files={assets['test']}",
            f"model.partial_pretrain={assets['model']}",
            f"trainer.default_local_dir={assets['root'] / 'inproc'}",
            "trainer.device=cpu",
            *overrides,
        ],
        demo=True,
    )


def test_accumulated_gradient_equals_the_float64_global_token_mean_gradient(assets, one_rank_group):
    """Four micro-batches of 2 must give the gradient of one mean over all response tokens of the
    batch (not a mean of micro-batch means), checked against a float64 reference model."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl.trainer.fsdp_sft_trainer import FSDPSFTTrainer, _trim_padding
    from verl.utils.dataset.sft_dataset import SFTDataset

    config = _config(assets, "data.train_batch_size=8", "data.micro_batch_size_per_gpu=2", "data.max_length=32")
    tokenizer = AutoTokenizer.from_pretrained(assets["model"])
    dataset = SFTDataset(assets["train"], tokenizer, config.data)
    trainer = FSDPSFTTrainer(config, init_device_mesh("cpu", (1,)), tokenizer=tokenizer, train_dataset=dataset)
    # Variable-length answers (2 or 3 digits) make per-micro-batch token counts differ.
    batch = _trim_padding(torch.utils.data.default_collate([dataset[i] for i in range(8)]))
    loss_sum, num_tokens = trainer.accumulate_gradients(batch)

    reference = AutoModelForCausalLM.from_pretrained(assets["model"], dtype=torch.float64)
    logits = reference(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
    ).logits
    log_probs = torch.log_softmax(logits[:, :-1], dim=-1)
    target_log_probs = log_probs.gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    mask = batch["loss_mask"][:, 1:].double()
    ref_loss = -(target_log_probs * mask).sum() / mask.sum()
    ref_loss.backward()

    assert num_tokens.item() == mask.sum().item()
    assert (loss_sum / num_tokens).item() == pytest.approx(ref_loss.item(), rel=1e-5)
    ref_grads = dict(reference.named_parameters())
    for name, param in trainer.model.named_parameters():
        grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
        torch.testing.assert_close(grad.double(), ref_grads[name].grad, rtol=1e-4, atol=1e-6, msg=name)


def test_batch_size_not_divisible_by_micro_batch_is_explained(assets, one_rank_group):
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoTokenizer

    from verl.trainer.fsdp_sft_trainer import FSDPSFTTrainer
    from verl.utils.dataset.sft_dataset import SFTDataset

    config = _config(assets, "data.train_batch_size=8", "data.micro_batch_size_per_gpu=3")
    tokenizer = AutoTokenizer.from_pretrained(assets["model"])
    dataset = SFTDataset(assets["train"], tokenizer, config.data)
    with pytest.raises(ValueError, match="micro_batch_size_per_gpu=3 does not divide"):
        FSDPSFTTrainer(config, init_device_mesh("cpu", (1,)), tokenizer=tokenizer, train_dataset=dataset)


def test_lr_schedules_are_upstreams_warm_up_from_zero_then_cosine_wsd_or_constant():
    """Upstream's SFT schedule: the first step's factor is 0 with a warm-up (step / warmup_steps), then the
    named decay; `lr_warmup_steps` > 0 overrides the ratio. Values worked by hand."""
    from omegaconf import OmegaConf

    from verl.trainer.fsdp_sft_config import sft_lr_factor

    def optim(**keys):
        base = {"lr_scheduler": "cosine", "lr_warmup_steps_ratio": 0.2, "lr_warmup_steps": -1}
        return OmegaConf.create({**base, "min_lr_ratio": 0.1, "num_cycles": 0.5, **keys})

    cosine = sft_lr_factor(optim(), total_steps=20)  # 4 warm-up steps, then 16 of half a cosine
    assert [cosine(s) for s in range(5)] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert cosine(12) == pytest.approx(0.1 + 0.9 * 0.5)  # half-way down: cos(pi/2) = 0
    assert cosine(20) == pytest.approx(0.1)
    assert sft_lr_factor(optim(min_lr_ratio=None), 20)(20) == pytest.approx(0.0)  # null: decay to 0
    assert sft_lr_factor(optim(lr_warmup_steps=2), 20)(1) == 0.5  # steps win over the ratio
    # wsd: 18 of the 20 steps held (upstream's stable ratio 0.9), then a cosine over the last 2
    wsd = sft_lr_factor(optim(lr_scheduler="wsd", lr_warmup_steps_ratio=0.0, min_lr_ratio=0.0), 20)
    assert [wsd(s) for s in (0, 17, 18, 19, 20)] == pytest.approx([1.0, 1.0, 1.0, 0.5, 0.0])
    assert sft_lr_factor(optim(lr_scheduler="constant", lr_warmup_steps_ratio=0.5), 10)(7) == 1.0
    with pytest.raises(ValueError, match="cosine"):
        sft_lr_factor(optim(lr_scheduler="linear"), 10)


def read_metrics(path) -> list[dict]:
    """The metrics the `file` tracker wrote, one flat dict (`step` and the metrics) per step."""
    with open(path) as f:
        return [{"step": record["step"], **record["data"]} for record in map(json.loads, f)]


def _torchrun(assets, run_dir, total_steps: int) -> subprocess.CompletedProcess:
    port = free_port()
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}",
        "-m", "verl.trainer.main_sft", "+demo=arith_sft",
        f"data.train_files={assets['train']}", f"data.val_files={assets['test']}",
        "data.train_batch_size=32", "data.micro_batch_size_per_gpu=8", "data.max_length=32",
        f"model.partial_pretrain={assets['model']}",
        "optim.lr=3e-3", "optim.lr_warmup_steps_ratio=0.0", "optim.lr_scheduler=constant",
        f"trainer.default_local_dir={run_dir}", f"trainer.total_training_steps={total_steps}",
        "trainer.save_freq=3", "trainer.test_freq=3", "trainer.logger=[console,file]", "trainer.device=cpu",
        f"hydra.run.dir={run_dir}/hydra", "hydra.output_subdir=null",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": REPO_ROOT, "OMP_NUM_THREADS": "1", "VERL_LOGGING_LEVEL": "INFO"}
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


@pytest.mark.slow
def test_two_process_cpu_run_learns_checkpoints_and_resumes(assets):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_dir = assets["root"] / "torchrun"
    _torchrun(assets, run_dir, total_steps=6)
    metrics = read_metrics(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    assert metrics[-1]["train/loss"] < 0.75 * metrics[0]["train/loss"]
    assert metrics[5]["val/loss"] < metrics[2]["val/loss"]
    assert (run_dir / "latest_checkpointed_iteration.txt").read_text() == "6"
    for step in (3, 6):
        assert (run_dir / f"global_step_{step}" / "dcp" / ".metadata").is_file()

    export = str(run_dir / "global_step_6" / "huggingface")
    model = AutoModelForCausalLM.from_pretrained(export)
    tokenizer = AutoTokenizer.from_pretrained(export)
    assert type(model).__name__ == "Qwen2ForCausalLM" and tokenizer.eos_token == "<eos>"

    result = _torchrun(assets, run_dir, total_steps=8)
    assert "resumed from" in result.stderr and "global_step_6 at global step 6" in result.stderr
    resumed = read_metrics(run_dir / "metrics.jsonl")[6:]
    assert [m["step"] for m in resumed] == [7, 8]
    # Restored weights, not a fresh start: the loss continues from where step 6 left it.
    assert resumed[0]["train/loss"] < 0.8 * metrics[0]["train/loss"]
    assert (run_dir / "latest_checkpointed_iteration.txt").read_text() == "8"


@pytest.mark.parametrize(
    "override, message",
    [
        ("+engine=veomni", r"^engine.strategy=veomni selects upstream's VeOmni engine, which is not in this build"),
        (
            "+engine=megatron",
            r"^engine \(verl.workers.config.McoreEngineConfig\) is a section of upstream's SFT engine trainer",
        ),
    ],
)
def test_selecting_upstreams_sft_engine_is_refused_in_one_line_before_anything_starts(override, message):
    from hydra import compose, initialize_config_dir

    from verl.trainer.fsdp_sft_trainer import run_sft

    with initialize_config_dir(config_dir=os.path.dirname(CONFIG), version_base=None):
        config = compose(config_name="sft_trainer", overrides=[override])  # upstream's yaml composes
    assert config.engine._target_.startswith("verl.workers.config.")
    with pytest.raises(ValueError, match=message) as raised:
        run_sft(config)
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "+data.prompt_keys=question",
            r"^data.prompt_keys is not a key of the SFT trainer .* Did you mean data.prompt_key\?",
        ),
        (
            "+trainer.max_ckpt_to_kep=2",
            r"^trainer.max_ckpt_to_kep is not a key .* Did you mean trainer.max_ckpt_to_keep\?",
        ),
        ("+model.fsdp_config.mixed_precision.param_dtyp=fp32", r"^model.fsdp_config.mixed_precision.param_dtyp is not"),
    ],
)
def test_an_unknown_key_is_refused_naming_the_closest_one_before_anything_starts(override, message):
    from hydra import compose, initialize_config_dir

    from verl.trainer.fsdp_sft_trainer import run_sft

    with initialize_config_dir(config_dir=os.path.dirname(CONFIG), version_base=None):
        config = compose(config_name="sft_trainer", overrides=[override])  # Hydra's `+` adds any key
    with pytest.raises(ValueError, match=message) as raised:
        run_sft(config)
    assert "\n" not in str(raised.value)
