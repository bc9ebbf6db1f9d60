"""The FSDP SFT trainer (`main_sft`) on one CUDA device: bf16 compute through FSDP2's mixed precision,
the packed forward (`use_remove_padding`), LoRA; the first step's loss against the float64 CPU loss of
the same batch. Skipped without a GPU (run by scripts/gpu_acceptance.sh)."""

from __future__ import annotations

import pytest
import torch

from tests.trainer.test_sft_trainer import read_metrics
from verl.models.factory import make_tiny
from verl.utils.dataset.arith import write_arith_parquet

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_bf16_packed_sft_steps_on_one_gpu_follow_the_float64_loss(nccl_group, tmp_path, lora):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl.trainer.fsdp_sft_config import sft_config
    from verl.trainer.fsdp_sft_trainer import run_sft, sft_train_loader
    from verl.utils.dataset.sft_dataset import SFTDataset

    model_dir = make_tiny("tiny", str(tmp_path / "model"), seed=0)
    train, test = write_arith_parquet(str(tmp_path / "data"), num_train=64, num_test=16, seed=0)
    run_dir = tmp_path / "run"
    config = sft_config(
        [
            f"data.train_files={train}",
            f"data.val_files={test}",
            "data.train_batch_size=16",
            "data.micro_batch_size_per_gpu=8",
            "data.max_length=32",
            f"model.partial_pretrain={model_dir}",
            "optim.lr=1e-2",
            "optim.lr_warmup_steps_ratio=0.0",
            "optim.lr_scheduler=constant",
            "use_remove_padding=true",
            f"model.lora_rank={8 if lora else 0}",
            f"trainer.default_local_dir={run_dir}",
            "trainer.total_training_steps=3",
            "trainer.logger=[file]",
            "trainer.device=cuda",
        ],
        demo=True,
    )
    trainer = run_sft(config)
    assert next(trainer.model.parameters()).device.type == "cuda"
    metrics = read_metrics(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert metrics[-1]["train/loss"] < metrics[0]["train/loss"]

    # the first step's batch, by hand in float64 on the CPU: the mean cross-entropy over the loss-masked tokens
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    dataset = SFTDataset(train, tokenizer, config.data)
    batch = next(iter(sft_train_loader(dataset, 0, 0, 16, 0, 1, seed=int(config.trainer.seed))))
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    with torch.no_grad():
        logits = reference(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
        ).logits
    nll = -torch.log_softmax(logits[:, :-1], -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    mask = batch["loss_mask"][:, 1:].double()
    expected = float((nll * mask).sum() / mask.sum())
    assert metrics[0]["train/loss"] == pytest.approx(expected, rel=2e-2)  # bf16 compute, fp32 loss
    assert (run_dir / "global_step_3" / "huggingface" / "model.safetensors").is_file()
    assert (run_dir / "global_step_3" / "lora_adapter").is_dir() == lora
