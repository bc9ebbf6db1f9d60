"""Supervised fine-tuning of a causal LM with FSDP2, under torchrun (or as one plain process).

    torchrun --nproc_per_node=2 -m verl.trainer.fsdp_sft_trainer \\
        data.train_files=~/data/gsm8k/train.parquet data.val_files=~/data/gsm8k/test.parquet \\
        data.prompt_key=extra_info data.response_key=extra_info \\
        data.prompt_dict_keys=['question'] data.response_dict_keys=['answer'] \\
        model.partial_pretrain=/path/to/hf_model trainer.default_local_dir=/tmp/sft trainer.total_epochs=2

Design decisions:
- Every rank holds a shard of the model: each decoder layer, then the root module, is wrapped with
  `torch.distributed.fsdp.fully_shard` over a 1-D device mesh of all ranks (gloo on CPU, NCCL on
  GPU; `verl.utils.device` decides). CPU is a first-class device here, not a simulation.
- The loss is the mean cross-entropy over all response tokens of the global batch (every rank and
  every micro-batch), not a mean of per-micro-batch means: each micro-batch's summed token loss is
  divided by the global token count (one all-reduce per step) and multiplied by the world size,
  because FSDP averages gradients across ranks. Gradient accumulation and the number of ranks
  therefore do not change the result.
- Each rank's batch is cut to its longest sequence before the forward pass (the dataset pads to
  `data.max_length`), so a short task costs what its tokens cost.
- `use_remove_padding` packs each micro-batch into one row; `ulysses_sequence_parallel_size` splits
  that row across groups of ranks (data sharded over the dp = world / sp groups only). Both live in
  `verl.trainer.sft_ulysses`; FSDP still shards over all ranks, so checkpoints do not depend on sp.
- Checkpoints: `default_local_dir/global_step_N/` holds the sharded model and optimizer state
  written with torch.distributed.checkpoint (`dcp/`), the scheduler and step counters
  (`extra_state.pt`) and a plain HF export (`huggingface/`: config, safetensors weights,
  tokenizer) that `from_pretrained` loads anywhere. `latest_checkpointed_iteration.txt` names the
  newest complete checkpoint; it is written only after every rank finished, so a crash mid-save
  resumes from the previous one. Resuming restores the data order too: the sampler is seeded by
  epoch and the already-seen batches of the current epoch are skipped.
- Metrics go to `trainer.logger`'s backends through `verl.utils.tracking.Tracking` (console, `file` =
  `default_local_dir/metrics.jsonl`, wandb, mlflow, ...), on rank 0. The config is upstream's
  sft_trainer.yaml; its checks and schedule live in `verl.trainer.fsdp_sft_config`.
- `fit(should_stop=...)` accepts a callback consulted after each validation, which is how the
  bundled model's build script stops at a target held-out accuracy without a special trainer.
"""

from __future__ import annotations

import math
import os
import shutil
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from verl.trainer.fsdp_sft_config import check_sft_config, check_sft_inputs, resolve_micro_batch_size, sft_lr_factor
from verl.trainer.sft_ulysses import SFTParallel, sft_token_losses
from verl.utils import device as device_utils
from verl.utils.checkpoint.checkpoint_manager import (
    copy_checkpoint_step,
    find_latest_ckpt_path,
    write_checkpoint_tracker,
)
from verl.utils.logging_utils import get_logger
from verl.utils.lora import lora_enabled
from verl.utils.optim import build_optimizer

logger = get_logger(__name__, level=os.environ.get("VERL_LOGGING_LEVEL", "INFO"))

RESUME_MODES = ("auto", "disable", "resume_path")
_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


class FSDPSFTTrainer:
    """Owns the sharded model, optimizer, data loaders and checkpoints of one SFT run.

    Args:
        config: the resolved `sft_trainer.yaml` config (an OmegaConf DictConfig).
        device_mesh: 1-D mesh over all ranks.
        ulysses_device_mesh: upstream's ("dp", "sp") mesh for `ulysses_sequence_parallel_size` > 1;
            None: the trainer builds it (the same consecutive groups).
        tokenizer: saved with every HF export.
        train_dataset, val_dataset: map-style datasets yielding `SFTDataset` items; `val_dataset`
            may be None (no validation).
    """

    def __init__(
        self, config, device_mesh, ulysses_device_mesh=None, tokenizer=None, train_dataset=None, val_dataset=None
    ):
        self.config = config
        self.device_mesh = device_mesh
        self.tokenizer = tokenizer
        self.train_dataset = train_dataset
        self.val_dataset = val_dataset
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.device = device_utils.get_device()
        # use_remove_padding / ulysses_sequence_parallel_size: checked, and the dp x sp grid built, before the model
        self.parallel = SFTParallel.from_config(config, device_utils.get_device_name(), mesh=ulysses_device_mesh)

        data = config.data
        self.micro_batch_size = int(data.micro_batch_size_per_gpu)
        self.batch_size_per_rank = _per_rank_batch_size(
            int(data.train_batch_size), self.micro_batch_size, self.parallel.dp_size
        )
        self.steps_per_epoch = len(train_dataset) // int(data.train_batch_size)
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"the training data has {len(train_dataset)} rows, fewer than data.train_batch_size="
                f"{data.train_batch_size}, so not even one step fits in an epoch; lower data.train_batch_size"
            )
        trainer = config.trainer
        if trainer.total_training_steps is not None:
            self.total_steps = int(trainer.total_training_steps)
        else:
            self.total_steps = self.steps_per_epoch * int(trainer.total_epochs)
        if self.total_steps < 1:
            raise ValueError(
                f"{self.total_steps} training steps planned; set trainer.total_epochs or trainer.total_training_steps >= 1"
            )
        self.checkpoint_dir = os.path.expanduser(trainer.default_local_dir)
        self.global_step = 0

        self.lora = lora_enabled(config.model)
        self.model = self._build_model()
        self.parallel.check_model(self.model)
        # `optim.optimizer` of `optim.optimizer_impl` (AdamW), over the trainable parameters (the adapters with LoRA)
        self.optimizer = build_optimizer([p for p in self.model.parameters() if p.requires_grad], config.optim)
        # The learning rate is a pure function of the step (no scheduler state to checkpoint), so a
        # resumed run, even one with a longer schedule, uses the rate its current config prescribes.
        self.lr_factor = sft_lr_factor(config.optim, self.total_steps)
        self.tracking = None
        if self.rank == 0:
            from omegaconf import OmegaConf

            from verl.utils.tracking import Tracking

            self.tracking = Tracking(
                project_name=trainer.project_name,
                experiment_name=trainer.experiment_name,
                default_backend=trainer.logger if isinstance(trainer.logger, str) else list(trainer.logger),
                config=OmegaConf.to_container(config, resolve=True),
                run_dir=self.checkpoint_dir,
            )

    # ----------------------------------------------------------------------------- model
    def _build_model(self):
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
        from transformers import AutoModelForCausalLM

        from verl.utils.fs import copy_to_local

        model_cfg = self.config.model
        if model_cfg.external_lib:
            import importlib

            importlib.import_module(model_cfg.external_lib)  # registers custom models with transformers
        model = AutoModelForCausalLM.from_pretrained(
            copy_to_local(os.path.expanduser(model_cfg.partial_pretrain), use_shm=bool(model_cfg.use_shm)),
            # master weights (fp32 by default); mixed precision applies to compute only
            dtype=_dtype(str(model_cfg.fsdp_config.model_dtype), "model_dtype", "model.fsdp_config"),
            trust_remote_code=bool(model_cfg.trust_remote_code),
        )
        if self.lora:
            from verl.utils.lora import apply_lora

            model.enable_input_require_grads()  # the frozen embeddings' output must carry gradients to the adapters
            model = apply_lora(model, model_cfg)
        if model_cfg.enable_gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        fsdp_cfg = model_cfg.fsdp_config
        kwargs = {
            "mesh": self.device_mesh,
            "mp_policy": MixedPrecisionPolicy(
                param_dtype=_dtype(fsdp_cfg.mixed_precision.param_dtype, "param_dtype"),
                reduce_dtype=_dtype(fsdp_cfg.mixed_precision.reduce_dtype, "reduce_dtype"),
            ),
        }
        if fsdp_cfg.cpu_offload:
            # Pinned host memory only helps (and only exists) with an accelerator to copy to.
            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device_utils.is_cuda_available())
        else:
            model.to(self.device)
        layers = _decoder_layers(model.get_base_model() if self.lora else model)
        for layer in layers:
            fully_shard(layer, **kwargs)
        fully_shard(model, **kwargs)
        return model

    # ----------------------------------------------------------------------------- data
    def _train_loader(self, epoch: int, skip_batches: int) -> DataLoader:
        return sft_train_loader(
            self.train_dataset,
            epoch,
            skip_batches,
            self.batch_size_per_rank,
            self.parallel.dp_rank,
            self.parallel.dp_size,
            int(self.config.trainer.seed),
        )

    def _val_loader(self) -> DataLoader:
        sampler = DistributedSampler(
            self.val_dataset, num_replicas=self.parallel.dp_size, rank=self.parallel.dp_rank, shuffle=False
        )
        return DataLoader(self.val_dataset, batch_size=self.micro_batch_size, sampler=sampler)

    # ----------------------------------------------------------------------------- steps
    def _token_losses(self, micro_batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.parallel.token_losses(self.model, micro_batch, self.device)

    def accumulate_gradients(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward/backward over this rank's micro-batches so that the accumulated gradient is the
        gradient of the global-batch mean token loss. Returns (summed token loss, token count), both
        summed over all ranks."""
        return accumulate_sft_gradients(
            self.model,
            batch,
            _split(batch, self.micro_batch_size),
            self.device,
            self.global_step + 1,
            token_losses=self._token_losses,
            sp_size=self.parallel.sp_size,
        )

    def training_step(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """One optimizer step on this rank's share of the global batch."""
        self.model.train()
        start = time.perf_counter()
        batch = _trim_padding(batch)
        loss_sum, num_tokens = self.accumulate_gradients(batch)
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        grad_norm = torch.nn.utils.clip_grad_norm_(trainable, float(self.config.optim.clip_grad))
        grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        lr = float(self.config.optim.lr) * self.lr_factor(self.global_step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if math.isfinite(grad_norm):
            self.optimizer.step()
        else:
            logger.warning(f"step {self.global_step + 1}: gradient norm is {grad_norm}; skipping the update")
        self.optimizer.zero_grad(set_to_none=True)
        # the ranks of an sp group hold the same rows
        tokens_total = (
            _all_reduce_sum(batch["attention_mask"].sum().to(self.device, torch.float32)) / self.parallel.sp_size
        )
        elapsed = time.perf_counter() - start
        return {
            "train/loss": (loss_sum / num_tokens).item(),
            "train/lr": lr,
            "train/lr(1e-3)": lr * 1e3,  # upstream's name
            "train/time(s)": elapsed,  # upstream's name
            "train/grad_norm": grad_norm,
            "train/response_tokens": num_tokens.item(),
            "perf/step_time_s": elapsed,
            "perf/tokens_per_s": tokens_total.item() / elapsed,
        }

    def validation_step(self) -> dict[str, float]:
        """Mean response-token cross-entropy over the whole validation set."""
        self.model.eval()
        loss_sum = torch.zeros((), device=self.device)
        num_tokens = torch.zeros((), device=self.device)
        with torch.no_grad():
            for batch in self._val_loader():
                token_loss_sum, count = self._token_losses(_trim_padding(batch))
                loss_sum += token_loss_sum
                num_tokens += count
        return {"val/loss": (_all_reduce_sum(loss_sum) / _all_reduce_sum(num_tokens).clamp(min=1)).item()}

    # ----------------------------------------------------------------------------- loop
    def fit(self, should_stop: Callable[[FSDPSFTTrainer, int], bool] | None = None) -> int:
        """Train until `total_steps` (or until `should_stop` says so) and return the last global step.

        `should_stop(trainer, global_step)` runs on every rank after each validation; it may run
        collectives (for instance a forward pass of the sharded model). Rank 0's answer decides.
        """
        from tqdm import tqdm

        self.load_checkpoint()
        if self.global_step >= self.total_steps:
            logger.info(f"checkpoint is at step {self.global_step} >= {self.total_steps} planned steps; nothing to do")
            return self.global_step
        test_freq = int(self.config.trainer.test_freq)
        save_freq = int(self.config.trainer.save_freq)
        progress = tqdm(
            total=self.total_steps, initial=self.global_step, desc="sft", disable=self.rank != 0, dynamic_ncols=True
        )
        stop = False
        while not stop and self.global_step < self.total_steps:
            epoch, skip = divmod(self.global_step, self.steps_per_epoch)
            for batch in self._train_loader(epoch, skip):
                metrics = self.training_step(batch)
                self.global_step += 1
                progress.update(1)
                last = self.global_step >= self.total_steps
                if self.val_dataset is not None and (last or (test_freq > 0 and self.global_step % test_freq == 0)):
                    metrics.update(self.validation_step())
                    stop = should_stop is not None and _broadcast_bool(should_stop(self, self.global_step))
                if self.tracking is not None:
                    self.tracking.log(data=metrics, step=self.global_step)
                if last or stop or (save_freq > 0 and self.global_step % save_freq == 0):
                    self.save_checkpoint()
                if last or stop:
                    break
        progress.close()
        if self.tracking is not None:
            self.tracking.finish()
        return self.global_step

    # ----------------------------------------------------------------------------- checkpoints
    def save_checkpoint(self) -> str:
        """Write `global_step_N/` (DCP shards, extra state, HF export) and advance the tracker file."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict

        from verl.models.factory import add_legacy_rope_theta
        from verl.models.tokenizer import save_tokenizer

        path = os.path.join(self.checkpoint_dir, f"global_step_{self.global_step}")
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        state = {"model": model_state}
        if "optimizer" in self.config.trainer.checkpoint.save_contents:
            state["optimizer"] = optim_state
        dcp.save(state, checkpoint_id=os.path.join(path, "dcp"))

        full_state = get_model_state_dict(
            self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )  # a collective: every rank takes part, rank 0 receives the full tensors
        if self.lora:  # the adapter alone, in peft's format (a collective too; rank 0 writes)
            from verl.utils.lora import save_lora_adapter

            save_lora_adapter(self.model, os.path.join(path, "lora_adapter"))
        if self.rank == 0:
            torch.save(
                {"global_step": self.global_step, "world_size": self.world_size},
                os.path.join(path, "extra_state.pt"),
            )
            hf_dir = os.path.join(path, "huggingface")
            model = self.model
            if self.lora:  # the export is the base model with the adapter merged in (W + scaling * B A)
                from verl.utils.lora import lora_scalings, merge_lora_state

                full_state = dict(merge_lora_state(full_state.items(), lora_scalings(self.model)))
                model = self.model.get_base_model()
            model.save_pretrained(hf_dir, state_dict=full_state, safe_serialization=True)
            add_legacy_rope_theta(os.path.join(hf_dir, "config.json"))
            save_tokenizer(self.tokenizer, hf_dir)
        dist.barrier()
        if self.rank == 0:
            write_checkpoint_tracker(self.checkpoint_dir, self.global_step)
            if self.config.trainer.default_hdfs_dir:
                copy_checkpoint_step(self.checkpoint_dir, self.global_step, self.config.trainer.default_hdfs_dir)
            self._remove_old_checkpoints()
        dist.barrier()
        logger.info(f"saved checkpoint {path}")
        return path

    def load_checkpoint(self) -> None:
        """Restore model, optimizer and step from the checkpoint `trainer.resume_mode` selects."""
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        from verl.utils.checkpoint.safe_load import dcp_load

        path = resolve_resume_path(self.config.trainer, self.checkpoint_dir)
        if path is None:
            return
        state = dict(zip(("model", "optimizer"), get_state_dict(self.model, self.optimizer)))
        if "optimizer" not in self.config.trainer.checkpoint.load_contents:
            del state["optimizer"]  # weights only: the optimizer starts fresh
        dcp_load(state, os.path.join(path, "dcp"))
        set_state_dict(
            self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state.get("optimizer", {})
        )
        extra = torch.load(os.path.join(path, "extra_state.pt"), weights_only=True)
        self.global_step = int(extra["global_step"])
        logger.info(f"resumed from {path} at global step {self.global_step}")

    def _remove_old_checkpoints(self) -> None:
        keep = self.config.trainer.max_ckpt_to_keep
        if keep is None or int(keep) <= 0:
            return
        steps = sorted(
            int(name.removeprefix("global_step_"))
            for name in os.listdir(self.checkpoint_dir)
            if name.startswith("global_step_") and name.removeprefix("global_step_").isdigit()
        )
        for step in steps[: -int(keep)]:
            shutil.rmtree(os.path.join(self.checkpoint_dir, f"global_step_{step}"), ignore_errors=True)


# --------------------------------------------------------------------------------- shared with sft_trainer
def sft_train_loader(
    dataset, epoch: int, skip_batches: int, batch_size_per_rank: int, rank: int, world_size: int, seed: int
) -> DataLoader:
    """This rank's batches of `epoch`, from batch `skip_batches` on: a seeded shuffle per epoch, so a
    resumed run sees the same order as an uninterrupted one."""
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=True)
    sampler.set_epoch(epoch)
    # A list of indices is a valid sampler; slicing it resumes mid-epoch without re-reading data.
    indices = list(sampler)[skip_batches * batch_size_per_rank :]
    return DataLoader(dataset, batch_size=batch_size_per_rank, sampler=indices, drop_last=True)


def accumulate_sft_gradients(
    model,
    batch: dict[str, torch.Tensor],
    micro_batches: list,
    device,
    step: int,
    token_losses: Callable[[dict[str, torch.Tensor]], tuple[torch.Tensor, torch.Tensor]] | None = None,
    sp_size: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward/backward over this rank's `micro_batches` (a split of `batch`) so that the accumulated
    gradient, once averaged over the ranks (FSDP, or the replicas' all-reduce), is the gradient of the
    global-batch mean token loss. Returns (summed token loss, token count), both summed over all ranks.

    `token_losses(micro_batch)` -> (summed token loss, count): default `sft_token_losses` of `model`.
    `sp_size`: ranks per Ulysses group; they hold the same rows and `token_losses` gives each the loss
    of its slice of them (`verl.trainer.sft_ulysses`), so the batch's token count, summed over all
    ranks, counts each token sp times. The slices' gradients sum to the rows' gradient, so the world
    factor (dp x sp) stays what FSDP's average over all ranks needs."""
    world_size = dist.get_world_size()
    if token_losses is None:

        def token_losses(micro_batch):
            return sft_token_losses(model, micro_batch, device)

    num_tokens = _all_reduce_sum(batch["loss_mask"][:, 1:].sum().to(device, torch.float32)) / sp_size
    if num_tokens.item() == 0:
        raise ValueError(
            f"step {step}: the global batch has no response tokens to learn from (every loss_mask is zero, e.g. "
            "all responses truncated away); check data.max_length and data.truncation"
        )
    loss_sum = torch.zeros((), device=device)
    for micro_batch in micro_batches:
        token_loss_sum, _ = token_losses(micro_batch)
        (token_loss_sum / num_tokens * world_size).backward()
        loss_sum += token_loss_sum.detach()
    return _all_reduce_sum(loss_sum), num_tokens


# --------------------------------------------------------------------------------- helpers
def extract_step(path: str) -> int | None:
    """The N of a `global_step_N` path (upstream's helper), or None."""
    import re

    match = re.search(r"global_step_(\d+)", str(path))
    return int(match.group(1)) if match else None


def resolve_resume_path(trainer_config, checkpoint_dir: str) -> str | None:
    """The `global_step_N` directory to resume from, or None to start from scratch."""
    mode = trainer_config.resume_mode
    if mode not in RESUME_MODES:
        raise ValueError(f"trainer.resume_mode={mode!r} is not one of {list(RESUME_MODES)}")
    if mode == "disable":
        return None
    if mode == "resume_path":
        path = trainer_config.resume_from_path
        if not path:
            raise ValueError("trainer.resume_mode=resume_path needs trainer.resume_from_path=<dir>/global_step_N")
        path = os.path.expanduser(path)
        if not os.path.isfile(os.path.join(path, "extra_state.pt")):
            raise FileNotFoundError(
                f"trainer.resume_from_path={path} is not a complete checkpoint (no extra_state.pt); "
                "point it at a global_step_N directory written by this trainer"
            )
        return path
    return find_latest_ckpt_path(checkpoint_dir)


def _per_rank_batch_size(train_batch_size: int, micro_batch_size: int, world_size: int) -> int:
    if train_batch_size % world_size:
        raise ValueError(
            f"data.train_batch_size={train_batch_size} is not divisible by the {world_size} data-parallel ranks; "
            f"set it to a multiple of {world_size} or change --nproc_per_node"
        )
    per_rank = train_batch_size // world_size
    if micro_batch_size < 1 or per_rank % micro_batch_size:
        raise ValueError(
            f"data.train_batch_size={train_batch_size} gives {per_rank} sequences per rank, which "
            f"data.micro_batch_size_per_gpu={micro_batch_size} does not divide; pick a micro batch size that "
            f"divides {per_rank}"
        )
    return per_rank


def _decoder_layers(model) -> list[torch.nn.Module]:
    """The repeated transformer blocks, each its own FSDP unit (all-gathered one at a time)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(
            f"{type(model).__name__} has no `model.layers` list of decoder blocks to shard; the SFT trainer supports "
            "decoder-only HF models laid out like Llama/Qwen2"
        )
    return list(layers)


def _dtype(name: str | None, key: str, section: str = "model.fsdp_config.mixed_precision") -> torch.dtype:
    """The dtype a `mixed_precision` key (or `model_dtype`) names; null: bf16 on CUDA (upstream's SFT
    compute dtype, with fp32 master weights), fp32 on CPU."""
    if name is None:
        return device_utils.default_compute_dtype()
    if name not in _DTYPES:
        raise ValueError(f"{section}.{key}={name!r} is not one of {sorted(_DTYPES)} (or null for the device's default)")
    return _DTYPES[name]


def _trim_padding(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop the right-padding columns that no sequence in `batch` uses."""
    length = max(int(batch["attention_mask"].sum(dim=1).max()), 2)
    return {k: v[:, :length] for k, v in batch.items()}


def _split(batch: dict[str, torch.Tensor], size: int) -> list[dict[str, torch.Tensor]]:
    num_rows = next(iter(batch.values())).shape[0]
    return [{k: v[i : i + size] for k, v in batch.items()} for i in range(0, num_rows, size)]


def _all_reduce_sum(value: torch.Tensor) -> torch.Tensor:
    value = value.clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value


def _broadcast_bool(flag: bool) -> bool:
    value = torch.tensor([int(bool(flag))], device=device_utils.get_device())
    dist.broadcast(value, src=0)
    return bool(value.item())


# --------------------------------------------------------------------------------- entry point
def init_distributed() -> None:
    """Join the torchrun process group, or form a one-process group when started without torchrun.

    The group is the workers' (`verl.single_controller.base.worker.init_process_group`): gloo on
    CPU, `cpu:gloo,cuda:nccl` bound to this rank's device on GPU, so host-side collectives on CPU
    tensors work next to NCCL, with the `VERL_DIST_TIMEOUT_S` deadline."""
    from verl.utils.distributed import join_process_group

    if dist.is_initialized():
        return
    join_process_group()


def resolve_defaults(config) -> None:
    """Fill the demo's nulls (`+demo=arith_sft`): the bundled arith-tiny model and the generated arithmetic
    task; with `data.use_shm`, read the data files from copies in /dev/shm."""
    from omegaconf import open_dict

    from verl.utils.fs import copy_to_local

    with open_dict(config):
        if config.data.use_shm:
            for key in ("train_files", "val_files"):
                files = config.data[key]
                if files is not None:
                    files = [files] if isinstance(files, str) else list(files)
                    config.data[key] = [copy_to_local(os.path.expanduser(f), use_shm=True) for f in files]
        if config.model.partial_pretrain is None:
            from verl.models import bundled_model_path

            config.model.partial_pretrain = bundled_model_path("arith-tiny")
        if config.data.train_files is None:
            from verl.utils.dataset.arith import ensure_arith_data

            if dist.get_rank() == 0:
                ensure_arith_data()  # one writer; the others read after the barrier
            dist.barrier()
            train_path, test_path = ensure_arith_data()
            config.data.train_files = train_path
            if config.data.val_files is None:
                config.data.val_files = test_path


def refuse_engine_section(config) -> None:
    """Refuse upstream's SFT engine-trainer selection (`engine=veomni`, `+engine=fsdp`, from its
    sft_trainer_engine.yaml): this trainer trains with FSDP2 from `model.fsdp_config` and would not
    read the section, so accepting it would silently train with another engine than the one asked for."""
    engine = config.get("engine")
    if engine is None:
        return
    strategy = engine.get("strategy") if hasattr(engine, "get") else engine
    target = engine.get("_target_") if hasattr(engine, "get") else None
    if strategy == "veomni" or str(target).endswith(".VeOmniEngineConfig"):
        raise ValueError(
            "engine.strategy=veomni selects upstream's VeOmni engine, which is not in this build (no VeOmni "
            "package); this SFT trainer trains with FSDP2: drop engine=veomni (and optim=veomni) and set "
            "model.fsdp_config.* and optim.* instead"
        )
    raise ValueError(
        f"engine ({target or f'strategy {strategy!r}'}) is a section of upstream's SFT engine trainer, which this SFT trainer does "
        "not read: it trains with FSDP2 from model.fsdp_config; remove the engine override"
    )


def create_sft_dataset(data_paths, data_config, tokenizer, max_samples: int = -1):
    """Upstream's dataset choice for main_sft: the class `data.custom_cls.path`/`.name` names, else
    `MultiTurnSFTDataset` with `data.multiturn.enable`, else the single-turn `SFTDataset`; built with
    upstream's keyword arguments (`parquet_files`, `tokenizer`, `config`, `max_samples`)."""
    from verl.utils.dataset.dataset_utils import sft_dataset_class
    from verl.utils.dataset.multiturn_sft_dataset import MultiTurnSFTDataset
    from verl.utils.dataset.sft_dataset import SFTDataset

    multiturn = (data_config.get("multiturn") or {}).get("enable", False)
    dataset_cls = sft_dataset_class(data_config, MultiTurnSFTDataset if multiturn else SFTDataset)
    return dataset_cls(parquet_files=data_paths, tokenizer=tokenizer, config=data_config, max_samples=max_samples)


def run_sft(config, should_stop: Callable[[FSDPSFTTrainer, int], bool] | None = None) -> FSDPSFTTrainer:
    """Build everything from `config` in this (already distributed) process and train."""
    from omegaconf import OmegaConf
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoTokenizer

    refuse_engine_section(config)
    check_sft_config(config)
    resolve_micro_batch_size(config)
    device_utils.set_device_preference(config.trainer.device)
    init_distributed()
    resolve_defaults(config)
    check_sft_inputs(config)
    torch.manual_seed(int(config.trainer.seed))
    mesh = init_device_mesh(device_utils.get_device_name(), (dist.get_world_size(),), mesh_dim_names=("fsdp",))
    from verl.utils.fs import copy_to_local

    model_path = copy_to_local(os.path.expanduser(config.model.partial_pretrain), use_shm=bool(config.model.use_shm))
    tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=bool(config.model.trust_remote_code))
    data_config = OmegaConf.to_container(config.data, resolve=True)
    train_dataset = create_sft_dataset(
        config.data.train_files, data_config, tokenizer, max_samples=data_config.get("train_max_samples", -1)
    )
    val_dataset = (
        create_sft_dataset(config.data.val_files, data_config, tokenizer, data_config.get("val_max_samples", -1))
        if config.data.val_files
        else None
    )
    trainer = FSDPSFTTrainer(config, mesh, tokenizer=tokenizer, train_dataset=train_dataset, val_dataset=val_dataset)
    if dist.get_rank() == 0:
        os.makedirs(trainer.checkpoint_dir, exist_ok=True)
        OmegaConf.save(config, os.path.join(trainer.checkpoint_dir, "sft_config.yaml"), resolve=True)
    trainer.fit(should_stop=should_stop)
    return trainer


def hydra_main(config_name: str, run) -> None:
    """`python -m` entry of an SFT trainer: compose `config_name` from verl/trainer/config with the
    command line's overrides, call `run(config)` and release the process group."""
    import hydra

    # An absolute path, so Hydra reads the YAML as a file whether this runs as a module or a script
    # and does not need verl/trainer/config to be a Python package.
    config_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "config")

    @hydra.main(config_path=config_dir, config_name=config_name, version_base=None)
    def _main(config) -> None:
        run(config)
        dist.destroy_process_group()

    _main()


def main() -> None:
    hydra_main("sft_trainer", run_sft)


if __name__ == "__main__":
    main()
