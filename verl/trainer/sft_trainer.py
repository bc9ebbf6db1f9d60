"""Supervised fine-tuning through the training-engine API (upstream's engine SFT trainer).

    torchrun --nproc_per_node=N -m verl.trainer.sft_trainer \\
        data.train_files=train.parquet data.val_files=test.parquet data.messages_key=messages \\
        model.path=/path/to/hf_model engine=fsdp optim.lr=1e-5 trainer.device=cpu trainer.logger=[console]

Config: `sft_trainer_engine.yaml` (upstream's keys and defaults), composed from the same groups as the
PPO roles: `model` (HFModelConfig), `engine` (FSDPEngineConfig), `optim`, `checkpoint`, `profiler`.

Design decisions:
- The model, its sharding, optimizer, lr schedule and checkpoints are the engine's (the
  `EngineRegistry`'s language-model engine for `engine=fsdp` or `engine=megatron`, the engines the PPO
  actor trains with); only the forward/backward differs per backend (`_FSDPPasses`, `_MegatronPasses`). The engine's batch keys (`use_dynamic_bsz`, `max_token_len_per_gpu`, `micro_batch_size_per_gpu`,
  ...) are filled from `data.*` and `model.*`, as upstream does.
- Data order, loss and gradient scaling are `main_sft`'s (`fsdp_sft_trainer.sft_train_loader`,
  `sft_token_losses`, `accumulate_sft_gradients`), not copies: the mean cross-entropy over every
  loss-masked token of the global batch, so micro-batching (fixed or by token budget) and the number of
  ranks do not change the result, and the per-step losses equal `main_sft`'s on the same data and seed.
- Data: `create_sft_dataset`, upstream's choice: a `data.custom_cls` class, else `MultiTurnSFTDataset`
  (a `messages_key` column of chat messages, loss on the assistant turns, per-row `tools_key` schemas and
  `enable_thinking_key` flags passed to the chat template). Items are built right-padded whatever
  `data.pad_mode` says: the forward cuts each batch to its longest sequence, so both modes train alike.
- Checkpoints: `default_local_dir/global_step_N/` is the engine's checkpoint (`checkpoint.save_contents`);
  `latest_checkpointed_iteration.txt` names the newest complete one. Resuming restores model, optimizer,
  lr schedule and RNG, and the data position (the step's epoch and batch, from the directory's step).
- Deliberately refused, each in one line when the config is checked (before any model loads): VeOmni
  (no such engine here), shared-memory loading, token balancing across ranks and profiling; once the
  ranks are known, a Megatron split (tp x pp x cp) that does not divide their number; and, by the
  dataset, rows with images or videos (no vision-language SFT).
"""

from __future__ import annotations

import os
import re
import time

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf, open_dict

from verl.trainer.config.errors import did_you_mean
from verl.trainer.fsdp_sft_trainer import (
    RESUME_MODES,
    _per_rank_batch_size,
    _trim_padding,
    accumulate_sft_gradients,
    hydra_main,
    init_distributed,
    sft_train_loader,
)
from verl.trainer.sft_ulysses import SFTParallel, check_sft_parallel
from verl.utils import device as device_utils
from verl.utils.checkpoint.checkpoint_manager import (
    copy_checkpoint_step,
    find_latest_ckpt_path,
    remote_checkpoint_dir_problem,
    write_checkpoint_tracker,
)
from verl.utils.dataset.dataset_utils import sft_dataset_class
from verl.utils.dataset.multiturn_sft_dataset import MultiTurnSFTDataset
from verl.utils.logging_utils import get_logger

logger = get_logger(__name__, level=os.environ.get("VERL_LOGGING_LEVEL", "INFO"))

SP_KEY, RP_KEY = "engine.ulysses_sequence_parallel_size", "model.use_remove_padding"
SECTIONS = ("data", "model", "engine", "optim", "checkpoint", "profiler", "trainer")
PAD_MODES = ("no_padding", "right")
AFTER_EACH_EPOCH = "after_each_epoch"

# data keys this trainer reads, and the keys accepted only at the value that switches a feature off
_DATA_KEYS = (
    "train_batch_size",
    "micro_batch_size_per_gpu",
    "max_token_len_per_gpu",
    "use_dynamic_bsz",
    "train_files",
    "val_files",
    "train_max_samples",
    "val_max_samples",
    "messages_key",
    "tools_key",
    "enable_thinking_key",
    "enable_thinking_default",
    "num_workers",
    "pad_mode",
    "max_length",
    "truncation",
    "balance_dp_token",
    "custom_cls",
    "use_shm",
    "apply_chat_template_kwargs",
    "ignore_input_ids_mismatch",
)
_DATA_OFF = {
    "balance_dp_token": (
        False,
        "balancing tokens across data-parallel ranks is not implemented (upstream's is a TODO)",
    ),
    "use_shm": (False, "files are read from their path; shared-memory copies are not implemented"),
}
_MEGATRON_MODEL_SPLITS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size")
_TRAINER_KEYS = (
    "default_local_dir",
    "default_hdfs_dir",
    "project_name",
    "experiment_name",
    "total_epochs",
    "total_training_steps",
    "logger",
    "seed",
    "save_freq",
    "test_freq",
    "max_ckpt_to_keep",
    "balance_batch",
    "resume_mode",
    "resume_from_path",
    "device",
    "nnodes",
    "n_gpus_per_node",
    "profile_interval",
)


# --------------------------------------------------------------------------------- config check
def check_config(config: DictConfig) -> None:
    """Refuse what this trainer cannot do, in one line each, before anything is built (raises ValueError)."""
    unknown = [k for k in config if k not in SECTIONS]
    if unknown:
        raise ValueError(
            f"unknown section(s) {unknown} in the SFT engine config;{did_you_mean(str(unknown[0]), list(SECTIONS))} "
            f"valid sections: {', '.join(SECTIONS)}"
        )
    _check_keys(config.data, _DATA_KEYS, "data")
    _check_keys(config.trainer, _TRAINER_KEYS, "trainer")
    data, trainer = config.data, config.trainer
    for key, (off, why) in _DATA_OFF.items():
        if data[key] != off and not (off == {} and not data[key]):
            raise ValueError(f"data.{key}={data[key]!r}: {why}; remove the override (keep data.{key}={off!r})")
    if data.pad_mode not in PAD_MODES:
        raise ValueError(f"data.pad_mode={data.pad_mode!r} is not one of {list(PAD_MODES)}")
    problem = remote_checkpoint_dir_problem(str(trainer.default_hdfs_dir)) if trainer.default_hdfs_dir else None
    if problem:
        raise ValueError(f"trainer.default_hdfs_dir={trainer.default_hdfs_dir!r}: {problem}")
    if config.checkpoint.get("async_save"):
        raise ValueError(
            "checkpoint.async_save=true: this SFT trainer writes checkpoints synchronously (background writes are "
            "implemented for main_ppo's actor and critic); set checkpoint.async_save=false"
        )
    if trainer.resume_mode not in RESUME_MODES:
        raise ValueError(f"trainer.resume_mode={trainer.resume_mode!r} is not one of {list(RESUME_MODES)}")
    if config.profiler.enable or list(trainer.profile_interval) != [-1, -1]:
        raise ValueError(
            "profiler.enable / trainer.profile_interval: profiling is not wired into the SFT engine trainer; "
            "keep profiler.enable=false and trainer.profile_interval=[-1,-1]"
        )
    for key in ("save_freq", "test_freq"):
        value = trainer[key]
        if value != AFTER_EACH_EPOCH and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"trainer.{key}={value!r} must be an integer (-1: only at the end) or {AFTER_EACH_EPOCH}")
    engine = config.engine
    target = str(engine.get("_target_", ""))
    _refuse_engine_batch_keys(engine, megatron=target.endswith("McoreEngineConfig"))
    if engine.get("strategy") == "veomni" or target.endswith("VeOmniEngineConfig"):
        raise ValueError(
            "engine=veomni selects upstream's VeOmni engine, which is not in this build; use engine=fsdp optim=fsdp"
        )
    sp = int(engine.get("ulysses_sequence_parallel_size") or 1)
    if sp > 1 and target.endswith("McoreEngineConfig"):
        raise ValueError(
            f"engine.ulysses_sequence_parallel_size={sp} is the FSDP engine's key; the Megatron engine splits "
            "sequences with engine.context_parallel_size"
        )
    # sp x remove padding here; the ranks and the model's heads when the engine's passes are built
    check_sft_parallel(sp, bool(config.model.use_remove_padding), None, sp_key=SP_KEY, remove_padding_key=RP_KEY)
    if config.model.path is None:
        raise ValueError("model.path is not set; pass model.path=<HF model directory>")


# where each engine batch key's value comes from (`build_engine` fills them)
_ENGINE_BATCH_SOURCES = {
    "use_dynamic_bsz": "data.use_dynamic_bsz",
    "max_token_len_per_gpu": "data.max_token_len_per_gpu",
    "micro_batch_size_per_gpu": "data.micro_batch_size_per_gpu",
    "infer_max_token_len_per_gpu": "data.max_token_len_per_gpu",
    "infer_micro_batch_size_per_gpu": "data.micro_batch_size_per_gpu",
    "use_fused_kernels": "model.use_fused_kernels",
    "use_remove_padding": "model.use_remove_padding",
}


def _refuse_engine_batch_keys(engine, megatron: bool) -> None:
    for key, source in _ENGINE_BATCH_SOURCES.items():
        if megatron and key == "use_remove_padding":
            continue  # upstream's engine/megatron.yaml holds it (a speed knob here)
        if key in engine:
            raise ValueError(
                f"engine.{key}={engine[key]!r}: this trainer fills the engine's batch keys from data.* and model.*, "
                f"as upstream's does; remove it and set {source}"
            )


def check_megatron_layout(engine, world_size: int) -> None:
    """Refuse a Megatron split that the ranks torchrun started cannot hold (raises ValueError)."""
    sizes = {k: int(engine.get(k) or 1) for k in _MEGATRON_MODEL_SPLITS}
    product = sizes["tensor_model_parallel_size"] * sizes["pipeline_model_parallel_size"]
    product *= sizes["context_parallel_size"]
    if world_size % product:
        split = " x ".join(f"engine.{k}={v}" for k, v in sizes.items())
        raise ValueError(
            f"{world_size} rank(s) cannot be split into {split} = {product}: the product must divide the number of "
            f"ranks; start a multiple of {product} ranks (torchrun --nproc_per_node) or lower the sizes"
        )


def _check_keys(section, valid: tuple[str, ...], name: str) -> None:
    for key in section:
        if key not in valid:
            raise ValueError(
                f"{name}.{key} is not a key of the SFT engine trainer's {name} section.{did_you_mean(str(key), list(valid), prefix=name + '.')}"
                f" Valid keys: {', '.join(valid)}"
            )


# --------------------------------------------------------------------------------- the engines' passes
def _sum_over(value: torch.Tensor, group) -> torch.Tensor:
    value = value.clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM, group=group)
    return value


class _FSDPPasses:
    """main_sft's forward/backward on the FSDP engine's HF module (`engine.module`), with main_sft's
    remove padding (`model.use_remove_padding`) and Ulysses groups (`engine.ulysses_sequence_parallel_size`,
    `verl.trainer.sft_ulysses`): rows are sharded over the dp = world / sp groups, each rank's loss is that
    of its slice of the group's packed rows, and the sums (`dp_group` None: every rank) add the slices up."""

    def __init__(self, engine, device, config):
        self.engine, self.device = engine, device
        model = config.model
        self.parallel = SFTParallel.build(
            int(config.engine.get("ulysses_sequence_parallel_size") or 1),
            bool(model.use_remove_padding),
            model.path,
            bool(model.trust_remote_code),
            device_utils.get_device_name(),
            sp_key=SP_KEY,
            remove_padding_key=RP_KEY,
        )
        self.parallel.check_model(engine.module)
        self.sp_size = self.parallel.sp_size
        # (group summing over every rank, this rank's data-parallel index, number of groups holding different rows)
        self.dp_group, self.dp_rank, self.dp_size = None, self.parallel.dp_rank, self.parallel.dp_size

    def token_budget(self, max_token_len: int) -> int:
        return max_token_len * self.sp_size  # a rank holds 1/sp of each row's tokens, as in the PPO roles

    def _token_losses(self, micro_batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        return self.parallel.token_losses(self.engine.module, micro_batch, self.device)

    def backward(self, batch: dict, micro_batches: list, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return accumulate_sft_gradients(
            self.engine.module,
            batch,
            micro_batches,
            self.device,
            step,
            token_losses=self._token_losses,
            sp_size=self.sp_size,
        )

    def clip(self, grad_clip: float) -> torch.Tensor:
        from verl.workers.dp_training import clip_grad_norm

        return clip_grad_norm(self.engine.module, grad_clip)

    def loss_sum(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        return self._token_losses(batch)


class _MegatronPasses:
    """The same loss through megatron's schedule on the Megatron engine's chunks, at any tensor, pipeline
    (virtual stages included), context and expert parallel layout.

    A sequence is laid out as the PPO actor's rows with a one-token prompt: its first token, then the rest
    as the "response", so the actor's left-aligned forward gives the log-prob of every target token (whole
    rows on every context-parallel rank: `response_columns` gathers them). The loss exists on the last
    pipeline stage; its sums go to the other stages (`_from_last_stage`) and over the data-parallel group."""

    sp_size = 1  # sequences split by context parallelism instead (counted in dp_group)

    def __init__(self, engine, device, config=None):
        from megatron.core import parallel_state as mpu

        self.engine, self.device = engine, device
        # the ranks of one tensor/pipeline/context group hold the same rows: only megatron's data-parallel
        # rank (without the context-parallel ranks) picks them
        self.dp_group = mpu.get_data_parallel_group()
        self.dp_rank, self.dp_size = mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()

    def token_budget(self, max_token_len: int) -> int:
        from verl.workers.actor.megatron_actor import per_rank_token_budget

        return per_rank_token_budget(max_token_len)  # a context-parallel rank holds 1/cp of each row

    def _from_last_stage(self, results: list, keys: tuple[str, ...]) -> list[torch.Tensor]:
        """The sums over the micro-batches of `results[i][key]` (the last stage's), on every stage."""
        from verl.workers.actor.megatron_actor import broadcast_from_last_stage

        sums = [float(torch.stack([r[key] for r in results]).sum()) for key in keys] if results else None
        return [torch.tensor(v, device=self.device) for v in broadcast_from_last_stage(sums)]

    def _token_log_probs(self, micro_batch, output) -> torch.Tensor:
        from verl.models.mcore.forward import response_columns
        from verl.utils.megatron.tensor_parallel import vocab_parallel_log_probs_and_entropy

        aligned = micro_batch["_aligned"]
        log_probs, _ = vocab_parallel_log_probs_and_entropy(
            output, aligned.model_labels, self.engine.hf_config.vocab_size, False
        )
        return response_columns(log_probs, aligned)  # [B, L-1]: log p(token t+1 | tokens <= t)

    def _schedule(self, micro_batches: list, loss_fn, forward_only: bool) -> list:
        from tensordict import TensorDict

        from verl.workers.actor.megatron_actor import run_megatron_schedule

        rows = [
            TensorDict({**dict(m.items()), "responses": m["input_ids"][:, 1:]}, batch_size=m.batch_size)
            for m in micro_batches
        ]
        return run_megatron_schedule(self.engine.chunks, rows, loss_fn, forward_only)

    def backward(self, batch: dict, micro_batches: list, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        num_tokens = _sum_over(batch["loss_mask"][:, 1:].sum().to(self.device, torch.float32), self.dp_group)
        if num_tokens.item() == 0:
            raise ValueError(
                f"step {step}: the global batch has no response tokens to learn from; check data.max_length and "
                "data.truncation"
            )
        dp_size = self.dp_size

        def loss_fn(micro_batch, output):
            mask = micro_batch["loss_mask"][:, 1:].to(output.dtype)
            token_loss_sum = -(self._token_log_probs(micro_batch, output).float() * mask).sum()
            # gradients are averaged over the data-parallel (x context-parallel) ranks by
            # finalize_megatron_grads, as main_sft's are under FSDP; a context-parallel rank's gradient is
            # cp times its share (verl.models.mcore.context_parallel), so the scale is the PPO actor's
            return token_loss_sum / num_tokens * dp_size, {"loss_sum": token_loss_sum.detach()}

        results = self._schedule(micro_batches, loss_fn, forward_only=False)
        (loss_sum,) = self._from_last_stage(results, ("loss_sum",))
        return _sum_over(loss_sum, self.dp_group), num_tokens

    def clip(self, grad_clip: float) -> torch.Tensor:
        from verl.workers.actor.megatron_actor import clip_grads_megatron, finalize_megatron_grads

        finalize_megatron_grads(self.engine.chunks)
        return clip_grads_megatron(self.engine.chunks, grad_clip)

    def loss_sum(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        from tensordict import TensorDict

        def loss_fn(micro_batch, output):
            mask = micro_batch["loss_mask"][:, 1:].to(output.dtype)
            token_loss_sum = -(self._token_log_probs(micro_batch, output).float() * mask).sum()
            return output.new_zeros(()), {"loss_sum": token_loss_sum, "count": mask.sum()}

        rows = batch["input_ids"].shape[0]
        results = self._schedule([TensorDict(dict(batch), batch_size=[rows])], loss_fn, forward_only=True)
        loss_sum, count = self._from_last_stage(results, ("loss_sum", "count"))
        return loss_sum, count


# --------------------------------------------------------------------------------- trainer
class SFTTrainer:
    """One SFT run on a training engine: the engine, the data loaders, the loop, checkpoints and metrics."""

    def __init__(self, config: DictConfig, engine, tokenizer, train_dataset, val_dataset=None):
        self.config = config
        self.engine = engine
        from verl.workers.engine import MegatronEngine

        passes = _MegatronPasses if isinstance(engine, MegatronEngine) else _FSDPPasses
        self.passes = passes(engine, device_utils.get_device(), config)
        self.tokenizer = tokenizer
        self.train_dataset = train_dataset
        self.val_dataset = val_dataset
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        # rows are sharded over the data-parallel ranks (every rank under FSDP; megatron's dp group)
        self.dp_group, self.dp_rank, self.dp_size = self.passes.dp_group, self.passes.dp_rank, self.passes.dp_size
        self.device = device_utils.get_device()
        data = config.data
        self.use_dynamic_bsz = bool(data.use_dynamic_bsz)
        self.micro_batch_size = int(data.micro_batch_size_per_gpu)
        self.max_token_len = self.passes.token_budget(int(data.max_token_len_per_gpu))
        self.batch_size_per_rank = _per_rank_batch_size(
            int(data.train_batch_size), 1 if self.use_dynamic_bsz else self.micro_batch_size, self.dp_size
        )
        self.steps_per_epoch = steps_per_epoch(len(train_dataset), int(data.train_batch_size))
        self.total_steps = total_steps(config.trainer, self.steps_per_epoch)
        self.checkpoint_dir = os.path.expanduser(config.trainer.default_local_dir)
        self.global_step = 0
        self.total_tokens = 0.0
        self.tracking = None
        if self.rank == 0:
            from verl.utils.tracking import Tracking

            self.tracking = Tracking(
                config.trainer.project_name,
                config.trainer.experiment_name,
                list(config.trainer.logger),
                OmegaConf.to_container(config, resolve=True),
                run_dir=self.checkpoint_dir,
            )
        from verl.utils.flops_counter import FlopsCounter

        self.flops_counter = FlopsCounter(engine.hf_config)

    # ----------------------------------------------------------------------------- steps
    def _micro_batches(self, batch: dict[str, torch.Tensor]) -> list:
        from tensordict import TensorDict

        from verl.workers.dp_training import split_micro_batches

        rows = batch["input_ids"].shape[0]
        micro_batches, _ = split_micro_batches(
            TensorDict(batch, batch_size=[rows]),
            micro_batch_size=self.micro_batch_size,
            use_dynamic_bsz=self.use_dynamic_bsz,
            max_token_len=self.max_token_len,
            # every rank runs as many micro-batches as the others: the engine's collectives pair up per pass
            dp_group=dist.group.WORLD,
        )
        return micro_batches

    def training_step(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """One optimizer step on this rank's share of the global batch; upstream's metric names."""
        from verl.workers.dp_training import step_if_finite

        start = time.perf_counter()
        self.engine.train_mode()
        batch = _trim_padding(batch)
        with self.engine.on_device(optimizer=True):
            loss_sum, num_tokens = self.passes.backward(batch, self._micro_batches(batch), self.global_step + 1)
            grad_norm = self.passes.clip(self.config.optim.clip_grad)
            grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
            if not step_if_finite(self.engine.optimizer, grad_norm):
                logger.warning(f"step {self.global_step + 1}: gradient norm is {grad_norm}; skipping the update")
            self.engine.optimizer.zero_grad(set_to_none=True)
        lr = self.engine.lr_scheduler_step()
        seqlens = batch["attention_mask"].sum(dim=1)
        # the ranks of an sp group hold the same rows
        sp = self.passes.sp_size
        global_tokens = _sum_over(seqlens.sum().to(self.device, torch.float32), self.dp_group).item() / sp
        self.total_tokens += global_tokens
        # each data-parallel replica's FLOPs (the whole model's, on its rows) over every rank's peak
        achieved, peak = self.flops_counter.estimate_flops(seqlens.tolist(), time.perf_counter() - start)
        mfu = _sum_over(torch.tensor(achieved / peak, device=self.device), self.dp_group).item() / self.world_size / sp
        return {
            "train/loss": (loss_sum / num_tokens).item(),
            "train/grad_norm": grad_norm,
            "train/lr": lr,
            "train/mfu": mfu,
            "train/global_tokens": global_tokens,
            "train/total_tokens(B)": self.total_tokens / 1e9,
        }

    @torch.no_grad()
    def validation_step(self) -> dict[str, float]:
        """Mean token cross-entropy over the whole validation set (`val/loss`)."""
        from torch.utils.data import DataLoader, DistributedSampler

        self.engine.eval_mode()
        sampler = DistributedSampler(self.val_dataset, num_replicas=self.dp_size, rank=self.dp_rank, shuffle=False)
        loss_sum = torch.zeros((), device=self.device)
        num_tokens = torch.zeros((), device=self.device)
        with self.engine.on_device():
            for batch in DataLoader(self.val_dataset, batch_size=self.micro_batch_size, sampler=sampler):
                token_loss_sum, count = self.passes.loss_sum(_trim_padding(batch))
                loss_sum += token_loss_sum
                num_tokens += count
        loss_sum, num_tokens = _sum_over(loss_sum, self.dp_group), _sum_over(num_tokens, self.dp_group)
        return {"val/loss": (loss_sum / num_tokens.clamp(min=1)).item()}

    # ----------------------------------------------------------------------------- loop
    def fit(self) -> list[dict[str, float]]:
        """Train until `total_steps`; returns each step's metrics (as logged)."""
        self.load_checkpoint()
        trainer = self.config.trainer
        history = []
        while self.global_step < self.total_steps:
            epoch, skip = divmod(self.global_step, self.steps_per_epoch)
            loader = sft_train_loader(
                self.train_dataset,
                epoch,
                skip,
                self.batch_size_per_rank,
                self.dp_rank,
                self.dp_size,
                int(trainer.seed),
            )
            for batch in loader:
                metrics = self.training_step(batch)
                self.global_step += 1
                last = self.global_step >= self.total_steps
                epoch_end = self.global_step % self.steps_per_epoch == 0
                if self.val_dataset is not None and (last or _due(trainer.test_freq, self.global_step, epoch_end)):
                    metrics.update(self.validation_step())
                if self.tracking is not None:
                    self.tracking.log(metrics, step=self.global_step)
                history.append(metrics)
                if last or _due(trainer.save_freq, self.global_step, epoch_end):
                    self.save_checkpoint()
                if last:
                    break
        if self.tracking is not None:
            self.tracking.finish()
        return history

    # ----------------------------------------------------------------------------- checkpoints
    def save_checkpoint(self) -> str:
        path = os.path.join(self.checkpoint_dir, f"global_step_{self.global_step}")
        max_keep = self.config.trainer.max_ckpt_to_keep
        self.engine.save_checkpoint(path, global_step=self.global_step, max_ckpt_to_keep=max_keep)
        dist.barrier()
        if self.rank == 0:
            write_checkpoint_tracker(self.checkpoint_dir, self.global_step)
            if self.config.trainer.default_hdfs_dir:
                copy_checkpoint_step(self.checkpoint_dir, self.global_step, self.config.trainer.default_hdfs_dir)
        dist.barrier()
        logger.info(f"saved checkpoint {path}")
        return path

    def load_checkpoint(self) -> None:
        path = resume_path(self.config.trainer, self.checkpoint_dir)
        if path is None:
            return
        # max_ckpt_to_keep counts the checkpoints of the runs before this one too (as main_sft's does)
        self.engine.checkpoint_manager.previous_saved_paths = existing_checkpoints(self.checkpoint_dir)
        self.engine.load_checkpoint(path)
        self.global_step = checkpoint_step(path)
        logger.info(f"resumed from {path} at global step {self.global_step}")


# --------------------------------------------------------------------------------- helpers
def steps_per_epoch(num_rows: int, train_batch_size: int) -> int:
    steps = num_rows // train_batch_size
    if steps == 0:
        raise ValueError(
            f"the training data has {num_rows} rows, fewer than data.train_batch_size={train_batch_size}, so not even "
            "one step fits in an epoch; lower data.train_batch_size"
        )
    return steps


def total_steps(trainer_config, per_epoch: int) -> int:
    if trainer_config.total_training_steps is not None:
        steps = int(trainer_config.total_training_steps)
    else:
        steps = per_epoch * int(trainer_config.total_epochs)
    if steps < 1:
        raise ValueError(
            f"{steps} training steps planned; set trainer.total_epochs or trainer.total_training_steps >= 1"
        )
    return steps


def _due(freq, step: int, epoch_end: bool) -> bool:
    if freq == AFTER_EACH_EPOCH:
        return epoch_end
    return int(freq) > 0 and step % int(freq) == 0


_STEP_DIR = re.compile(r"global_step_(\d+)$")


def checkpoint_step(path: str) -> int:
    match = _STEP_DIR.search(os.path.normpath(path))
    if match is None:
        raise ValueError(f"{path} is not a global_step_N checkpoint directory of this trainer")
    return int(match.group(1))


def existing_checkpoints(checkpoint_dir: str) -> list[str]:
    """The `global_step_N` directories under `checkpoint_dir`, oldest first."""
    if not os.path.isdir(checkpoint_dir):
        return []
    found = [(m, name) for name in os.listdir(checkpoint_dir) if (m := _STEP_DIR.fullmatch(name))]
    return [os.path.join(checkpoint_dir, name) for m, name in sorted(found, key=lambda x: int(x[0].group(1)))]


def resume_path(trainer_config, checkpoint_dir: str) -> str | None:
    """The `global_step_N` directory `trainer.resume_mode` selects, or None to start from scratch."""
    mode = trainer_config.resume_mode
    if mode == "disable":
        return None
    if mode == "resume_path":
        path = trainer_config.resume_from_path
        if not path or not os.path.isdir(os.path.expanduser(path)):
            raise ValueError(
                f"trainer.resume_mode=resume_path needs trainer.resume_from_path=<dir>/global_step_N of an existing "
                f"checkpoint (got {path!r})"
            )
        path = os.path.expanduser(path)
        checkpoint_step(path)
        return path
    return find_latest_ckpt_path(checkpoint_dir)


def create_sft_dataset(data_paths, data_config, tokenizer, processor, max_samples: int = -1):
    """Upstream's dataset choice for this trainer: the class `data.custom_cls.path`/`.name` names, else
    `MultiTurnSFTDataset`; built with upstream's keyword arguments (`parquet_files`, `tokenizer`,
    `config`, `processor`, `max_samples`)."""
    dataset_cls = sft_dataset_class(data_config, MultiTurnSFTDataset)
    return dataset_cls(
        parquet_files=data_paths, tokenizer=tokenizer, config=data_config, processor=processor, max_samples=max_samples
    )


def _dataset(files, tokenizer, data, max_samples: int):
    """The trainer's dataset: right-padded items whatever `data.pad_mode` says (the forward cuts each batch
    to its longest sequence, so the two modes train alike), checked on its first item."""
    config = OmegaConf.to_container(data, resolve=True) if OmegaConf.is_config(data) else dict(data)
    config["pad_mode"] = "right"
    dataset = create_sft_dataset(files, config, tokenizer, processor=None, max_samples=max_samples)
    item = dataset[0]
    expected = {"input_ids", "attention_mask", "position_ids", "loss_mask"}
    shapes = {key: tuple(item[key].shape) for key in expected & set(item) if isinstance(item[key], torch.Tensor)}
    if set(shapes) != expected or set(shapes.values()) != {(int(config.get("max_length", 1024)),)}:
        raise ValueError(
            f"the SFT dataset {type(dataset).__name__} returns items with {shapes or sorted(item)}; this trainer needs "
            f"{sorted(expected)}, each a 1-D tensor of data.max_length={config.get('max_length', 1024)} tokens, right-padded "
            "(what MultiTurnSFTDataset returns with pad_mode=right, which this trainer passes in the config)"
        )
    return dataset


def build_engine(config: DictConfig, total: int, tokenizer):
    """The language-model engine the config's `engine` section selects, with its batch keys filled from `data.*`."""
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import HFModelConfig, McoreEngineConfig
    from verl.workers.engine import EngineRegistry

    with open_dict(config):
        config.optim.total_training_steps = total
    engine_config = omega_conf_to_dataclass(config.engine)
    data, model = config.data, config.model
    engine_config.use_dynamic_bsz = bool(data.use_dynamic_bsz)
    engine_config.max_token_len_per_gpu = int(data.max_token_len_per_gpu)
    engine_config.micro_batch_size_per_gpu = int(data.micro_batch_size_per_gpu)
    engine_config.infer_max_token_len_per_gpu = int(data.max_token_len_per_gpu)
    engine_config.infer_micro_batch_size_per_gpu = int(data.micro_batch_size_per_gpu)
    engine_config.use_remove_padding = bool(model.use_remove_padding)
    engine_config.use_fused_kernels = bool(model.use_fused_kernels)
    backend = "megatron" if isinstance(engine_config, McoreEngineConfig) else engine_config.strategy
    if backend != "megatron":  # the trainer splits sequences itself (verl.trainer.sft_ulysses)
        from verl.workers.engine.fsdp.transformer_impl import without_engine_ulysses

        engine_config = without_engine_ulysses(engine_config)
    engine_cls = EngineRegistry.get_engine_cls("language_model", backend)
    engine_cls.init_parallel(engine_config)  # megatron's process groups; FSDP: every rank a data-parallel rank
    return engine_cls(
        omega_conf_to_dataclass(config.model, HFModelConfig),
        engine_config,
        optimizer_config=omega_conf_to_dataclass(config.optim),
        checkpoint_config=omega_conf_to_dataclass(config.checkpoint),
        tokenizer=tokenizer,
    )


def check_typed_sections(config: DictConfig) -> None:
    """Check the `model`, `engine`, `optim`, `checkpoint` and `profiler` sections against their dataclasses
    as the PPO config check does (unknown keys with the closest valid one, types, choices, and an
    unimplemented feature switched on), then build each (its own `__post_init__` checks)."""
    from hydra.utils import get_class

    from verl.trainer.config.interpolation import plain
    from verl.trainer.config.schema_walk import _check_section
    from verl.utils.config import omega_conf_to_dataclass

    values = plain(config)
    for section in ("model", "engine", "optim", "checkpoint", "profiler"):
        errors: list[tuple[str, str]] = []
        _check_section(values[section], get_class(values[section]["_target_"]), f"{section}.", errors, [], [])
        # a key upstream's sft_trainer_engine.yaml leaves out (checkpoint.async_save) keeps its dataclass default
        errors = [message for _, message in errors if "is missing" not in message]
        if errors:
            raise ValueError(errors[0])
        omega_conf_to_dataclass(config[section])


def build_trainer(config: DictConfig) -> SFTTrainer:
    """Check the config and build the engine, data and trainer in this (torchrun or single) process."""

    check_config(config)
    check_typed_sections(config)
    device_utils.set_device_preference(config.trainer.device)
    init_distributed()
    if str(config.engine.get("_target_", "")).endswith("McoreEngineConfig"):
        check_megatron_layout(config.engine, dist.get_world_size())
    from verl.utils.tokenizer import hf_tokenizer

    model = config.model
    tokenizer = hf_tokenizer(
        os.path.expanduser(model.tokenizer_path or model.path), trust_remote_code=bool(model.trust_remote_code)
    )
    data = config.data
    train_dataset = _dataset(data.train_files, tokenizer, data, data.train_max_samples)
    val_dataset = _dataset(data.val_files, tokenizer, data, data.val_max_samples) if data.val_files else None
    total = total_steps(config.trainer, steps_per_epoch(len(train_dataset), int(data.train_batch_size)))
    torch.manual_seed(int(config.trainer.seed))
    engine = build_engine(config, total, tokenizer)
    trainer = SFTTrainer(config, engine, tokenizer, train_dataset, val_dataset)
    if trainer.rank == 0:
        os.makedirs(trainer.checkpoint_dir, exist_ok=True)
        OmegaConf.save(config, os.path.join(trainer.checkpoint_dir, "sft_config.yaml"), resolve=True)
    return trainer


def run_sft(config: DictConfig) -> list[dict[str, float]]:
    """Check the config, build everything and train; returns each step's metrics."""
    return build_trainer(config).fit()


def main() -> None:
    hydra_main("sft_trainer_engine", run_sft)


if __name__ == "__main__":
    main()
