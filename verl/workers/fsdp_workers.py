"""The Ray-facing workers: FSDP2 training, the rollout engine and reference/critic/reward models.

Each class is a thin RPC surface. The training logic lives in Ray-free classes
(`DataParallelPPOActor`, `DataParallelPPOCritic`, the rollout engines) and this module wires them
to devices, FSDP2 and checkpoints.

`ActorRolloutRefWorker(config, role)` is built by composition: the role string decides once, in
`__init__`, which of three parts exist — `_ActorPart` (FSDP model + optimizer + scheduler +
checkpoints), `_RolloutPart` (the generation engine, fed weights from the actor before each
generation and put to sleep afterwards: the hybrid engine) and `_RefPart` (a frozen FSDP copy).
Every RPC delegates to its part; calling an RPC whose part this role lacks is a clear error.

LoRA (`model.lora_rank > 0` or `model.lora_adapter_path`, see `verl.utils.lora`): the actor's
model is wrapped with peft before sharding (fresh adapters, or a trained adapter's) and only the
adapters train. The reference policy is then not a second model
but the actor's own module with its adapters switched off, and the rollout engine receives the
merged weights `W + scaling * B @ A` under plain HF names.

Offload (`fsdp_config.param_offload` / `optimizer_offload`, upstream's hybrid-engine switches): the
sharded parameters, and the Adam moments, live on the host between uses and come to the device only
for the RPC that needs them (`_FSDPModel.on_device`), so the rollout engine and the training phases
do not hold them at the same time. On a CPU device both are no-ops.

Batch-size normalisation follows upstream: `ppo_mini_batch_size` counts prompts, so it is
multiplied by `rollout.n` and divided by the data-parallel size; `*_micro_batch_size_per_gpu` is
already per rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf, open_dict

from verl.protocol import DataProto
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register
from verl.utils import device as dev
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.logging_utils import get_logger
from verl.utils.profiler import DistProfiler, DistProfilerExtension
from verl.utils.speed_paths import SpeedPath
from verl.utils.speed_paths import merge as merge_speed_paths
from verl.utils.ulysses import SP_KEY
from verl.workers.config import FSDPEngineConfig
from verl.workers.ulysses_rows import UlyssesRows, scale_token_budgets

logger = get_logger(__name__)

_ROLES = {
    "actor": ("actor",),
    "rollout": ("rollout",),
    "ref": ("ref",),
    "actor_rollout": ("actor", "rollout"),
    "actor_rollout_ref": ("actor", "rollout", "ref"),
}


def _join_group(worker: Worker, timeout_s=None) -> None:
    """Join the group's torch.distributed group once per process (colocated roles share it: the
    first role built, the actor in main_ppo's pools, sets the backend and the timeout).

    `timeout_s` is the role's `nccl_timeout` (`actor_rollout_ref.nccl_timeout`; None: the
    `VERL_DIST_TIMEOUT_S` / 600 s default). The backend is gloo on CPU and `cpu:gloo,cuda:nccl` on
    GPU (see `verl.single_controller.base.worker`). Seeds torch identically on every rank, so
    freshly initialised weights (a critic's value head) agree across ranks; `_seed_sampling` later
    gives each rank its own sampling stream.
    """
    if not dist.is_initialized():
        worker.init_process_group(timeout_s=None if timeout_s is None else float(timeout_s))
    dev.set_device()
    torch.manual_seed(_SEED)
    # One CPU bundle per worker: use the threads Ray granted, not every core of the machine.
    if not dev.is_cuda_available():
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", 1))))


_SEED = 0


def _seed_sampling() -> None:
    """A per-rank random stream for sampling, so a fixed-seed run is reproducible (checkpoints save it)."""
    torch.manual_seed(_SEED + dist.get_rank())


def _normalize_batch_sizes(actor_cfg: DictConfig, rollout_n: int, dp_size: int) -> None:
    """Turn prompt-counted global sizes into per-rank sample counts, with errors that say how to fix."""
    with open_dict(actor_cfg):
        global_mini = actor_cfg.ppo_mini_batch_size * rollout_n
        if global_mini % dp_size:
            raise ValueError(
                f"actor.ppo_mini_batch_size={actor_cfg.ppo_mini_batch_size} x rollout.n={rollout_n} = {global_mini} "
                f"samples is not divisible by the {dp_size} data-parallel ranks; choose a mini-batch size "
                f"so that the product is a multiple of {dp_size}"
            )
        actor_cfg.ppo_mini_batch_size = global_mini // dp_size
        micro = actor_cfg.get("ppo_micro_batch_size_per_gpu")
        per_rank = actor_cfg.ppo_mini_batch_size
        if not actor_cfg.get("use_dynamic_bsz", False) and micro and micro < per_rank and per_rank % micro:
            raise ValueError(
                f"the per-rank mini-batch of {per_rank} samples is not divisible by "
                f"actor.ppo_micro_batch_size_per_gpu={micro}; pick a micro-batch size that divides it"
            )


# per-rank token budgets that count tokens per micro-batch: with sp > 1 a rank holds 1/sp of them
_CRITIC_TOKEN_BUDGETS = ("ppo_max_token_len_per_gpu", "forward_max_token_len_per_gpu")


def _actor_ulysses_rows(config: DictConfig) -> UlyssesRows:
    """The actor's (and reference's) dp x sp layout; the reference runs with the actor's size."""
    sp = int((config.get("actor") or {}).get(SP_KEY, 1) or 1)
    ref_sp = (config.get("ref") or {}).get(SP_KEY)
    if "ref" in config and ref_sp is not None and int(ref_sp) != sp:
        raise ValueError(
            f"actor_rollout_ref.ref.{SP_KEY}={ref_sp} differs from actor_rollout_ref.actor.{SP_KEY}={sp}: the "
            "reference shares the actor's workers and their sequence-parallel groups; set both to the same value"
        )
    rows = UlyssesRows(sp, "actor_rollout_ref.actor")
    with open_dict(config):
        scale_token_budgets(config.actor, ("ppo_max_token_len_per_gpu",), rows.sp)
        for part in ("rollout", "ref"):
            if config.get(part) is not None:
                scale_token_budgets(config[part], ("log_prob_max_token_len_per_gpu",), rows.sp)
    return rows


def _log_prob_meta(data: DataProto, cfg: DictConfig, temperature: float) -> None:
    data.meta_info.setdefault("micro_batch_size", cfg.get("log_prob_micro_batch_size_per_gpu") or len(data))
    data.meta_info.setdefault("use_dynamic_bsz", cfg.get("log_prob_use_dynamic_bsz", False))
    data.meta_info.setdefault("max_token_len", cfg.get("log_prob_max_token_len_per_gpu", 16384))
    data.meta_info.setdefault("temperature", temperature)


@contextlib.contextmanager
def _device_timer():
    """Seconds of the work inside the block, device included: synchronised on entry and exit (the
    device runs behind the host, so an unsynchronised clock would read the launches, not the work).
    Yields a one-element list that holds the seconds after the block."""
    seconds = [0.0]
    dev.synchronize()
    start = time.perf_counter()
    yield seconds
    dev.synchronize()
    seconds[0] = time.perf_counter() - start


def _mfu_metric(flops: float | None, seconds: float, dp_size: int) -> float | None:
    """perf/mfu of an update: the FLOPs its model ran on this rank (`FlopsTally.total`), over all ranks
    (`verl.utils.flops_counter.mfu_over_ranks`, a collective where a peak is known)."""
    from verl.utils.flops_counter import mfu_over_ranks

    if flops is None:
        return None
    return mfu_over_ranks(flops, seconds, dp_size)


def fsdp_engine_config(section) -> FSDPEngineConfig:
    """A role's `fsdp_config` section as the typed `FSDPEngineConfig`, built once where the model is.

    Keys the section leaves out take the class's (upstream's) defaults, e.g. `dtype=bfloat16`; None (a
    role without the section) is all defaults. An already-built config is returned as is.
    """
    if isinstance(section, FSDPEngineConfig):
        return section
    return omega_conf_to_dataclass(section if section is not None else {}, FSDPEngineConfig)


def _plain(section) -> dict:
    """A config section (DictConfig, dict or None) as a plain dict."""
    if section is None:
        return {}
    return OmegaConf.to_container(section, resolve=True) if OmegaConf.is_config(section) else dict(section)


def _model_speed_paths(model_cfg, trainer, role_cfg=None) -> list[SpeedPath]:
    """Remove padding and fused kernels of an actor, reference or critic (`trainer`) built from
    `model_cfg` (see `verl.utils.speed_paths`); `role_cfg` (the actor section) can ask for the
    fused kernels too (`actor.use_fused_kernels`, which upstream's YAML takes from the model's)."""
    remove_padding = bool(model_cfg.get("use_remove_padding", False))
    packs = remove_padding and bool(getattr(trainer, "use_remove_padding", False))
    fused = bool(model_cfg.get("use_fused_kernels", False) or model_cfg.get("use_liger", False))
    fused = fused or bool((role_cfg or {}).get("use_fused_kernels", False))
    return [
        SpeedPath(
            "remove_padding",
            remove_padding,
            packs,
            ""
            if packs or not remove_padding
            else f"{type(trainer).__name__} does not implement it: it runs padded rows",
        ),
        SpeedPath(
            "fused_kernels",
            fused,
            False,
            "not implemented (use_fused_kernels and use_liger are accepted for upstream configs): log-probs and "
            "entropies run as chunked torch kernels, which bound memory the way the fused ones do"
            if fused
            else "",
        ),
    ]


class _FSDPModel:
    """An HF model on this rank's device, wrapped with FSDP2 over all ranks of the group (a small
    model in the model's own dtype: plain replicas instead, see `_trains_as_plain_replicas`).

    A model trained with `model_cfg.lora_rank > 0` (or a `lora_adapter_path`) is wrapped with LoRA
    adapters first (FSDP2 then shards base weights and adapters alike; only the adapters require
    gradients).
    """

    def __init__(self, model_cfg: DictConfig, fsdp_cfg, for_training: bool, value_head: bool = False):
        from verl.utils.fsdp_utils import apply_fsdp2, load_full_state_from_rank0
        from verl.utils.lora import apply_lora, lora_enabled
        from verl.utils.model import enable_gradient_checkpointing, load_causal_lm, load_valuehead_model

        fsdp = fsdp_engine_config(fsdp_cfg)
        if fsdp.full_determinism:  # before anything random (a value head's initialisation)
            dev.enable_full_determinism(fsdp.seed)
        # Only rank 0 reads the checkpoint; the other ranks start on the meta device and get its
        # weights by broadcast once wrapped (`load_full_state_from_rank0`).
        from_rank0 = dist.is_initialized() and dist.get_world_size() > 1
        on_meta = from_rank0 and dist.get_rank() > 0
        loader = load_valuehead_model if value_head else load_causal_lm
        self.module = loader(
            model_cfg.path,
            trust_remote_code=model_cfg.get("trust_remote_code", False),
            override_config=_plain(model_cfg.get("override_config")),
            meta_device=on_meta,
        )
        if for_training and model_cfg.get("enable_gradient_checkpointing", False):
            enable_gradient_checkpointing(self.module)
        if not for_training:
            self.module.requires_grad_(False)
        self.lora = for_training and not value_head and lora_enabled(model_cfg)
        if self.lora:
            # with model.lora_adapter_path the adapters start from its weights (a meta-device rank
            # checks their shapes only and receives them with rank 0's broadcast below)
            self.module = apply_lora(self.module, model_cfg, read_adapter_weights=not on_meta)
        full_state = self.module.state_dict() if from_rank0 and not on_meta else None
        if _trains_as_plain_replicas(fsdp, self.module):
            from verl.workers.dp_training import replicate_over_ranks

            self.module = replicate_over_ranks(self.module if on_meta else self.module.to(dev.get_device()))
            device = dev.get_device()
        else:
            sharding = _auto_replicate(fsdp, self.module)
            self.module = apply_fsdp2(self.module, sharding)
            # FSDP2's CPU offload keeps the shards on the host
            device = "cpu" if sharding.offload_policy else dev.get_device()
        if from_rank0:
            load_full_state_from_rank0(self.module, full_state, device)
            del full_state
        self.optimizer = None
        self.param_offload = fsdp.param_offload
        self.optimizer_offload = fsdp.optimizer_offload and for_training
        self._offload(optimizer=False)

    def _offload(self, optimizer: bool) -> None:
        from verl.utils.fsdp_utils import offload_fsdp_model_to_cpu, offload_fsdp_optimizer

        if self.param_offload:
            offload_fsdp_model_to_cpu(self.module)
        if optimizer and self.optimizer_offload and self.optimizer is not None:
            offload_fsdp_optimizer(self.optimizer)

    @contextlib.contextmanager
    def on_device(self, optimizer: bool = False):
        """The parameters (and, with `optimizer`, the optimizer state) on the device for the block;
        back on the host afterwards when offloaded."""
        from verl.utils.fsdp_utils import load_fsdp_model_to_device, load_fsdp_optimizer

        if self.param_offload:
            load_fsdp_model_to_device(self.module)
        if optimizer and self.optimizer_offload and self.optimizer is not None:
            load_fsdp_optimizer(self.optimizer)
        try:
            yield
        finally:
            self._offload(optimizer)

    @property
    def hf_config(self):
        """The HF config of the model."""
        return getattr(self.module, "config", None)

    def hf_params(self, dtype: torch.dtype | None = None):
        """`(hf_name, full_tensor)` pairs, streamed (collective): with LoRA, the merged weights.
        `dtype` (the rollout's) casts floating-point tensors: each shard before its all-gather, or,
        with LoRA, each merged weight (the merge itself runs in at least float32)."""
        from verl.utils.fsdp_utils import iter_full_params

        if not self.lora:
            return iter_full_params(self.module, dtype=dtype)
        from verl.utils.lora import lora_scalings, merge_lora_state

        merged = merge_lora_state(iter_full_params(self.module), lora_scalings(self.module))
        return merged if dtype is None else _cast_floating(merged, dtype)

    def adapters_disabled(self):
        """Context in which the model computes as its base model (LoRA adapters off); a no-op without LoRA."""
        return self.module.disable_adapter() if self.lora else contextlib.nullcontext()


def _cast_floating(named_tensors, dtype: torch.dtype):
    for name, tensor in named_tensors:
        yield name, tensor.to(dtype) if tensor.is_floating_point() else tensor


def rollout_dtype(rollout_cfg) -> torch.dtype:
    """The dtype the rollout engine holds its weights in (`rollout.dtype`; auto: bf16 on an
    accelerator, fp32 on CPU): what weight sync casts to before gathering and sending."""
    from verl.workers.rollout.native.engine import resolve_dtype

    return resolve_dtype(rollout_cfg.get("dtype", "auto"), dev.get_device())


def sync_rollout_weights(model, rollout, dtype: torch.dtype) -> None:
    """The hybrid engine's weight sync: the trained model's full weights, cast to the rollout's
    `dtype` shard by shard, streamed into `rollout` (woken up first). Every rank calls it (the
    gathers are collectives); a rank without an engine (`rollout` None) only takes part in them.
    `model` is the actor's model holder (`_FSDPModel`, or another backend's with `on_device` and
    `hf_params(dtype)`)."""
    with model.on_device():
        params = model.hf_params(dtype)
        if rollout is None:
            for _ in params:
                pass
        else:
            rollout.wake_up()
            rollout.update_weights(params)


# Below this many parameters `fsdp_size=-1` replicates the model (fsdp_size=1) instead of sharding
# it: the whole training state (weights, gradients, AdamW moments: 16 bytes per fp32 parameter) is
# then at most 256 MiB per rank, and every per-layer all-gather and reduce-scatter is saved (on the
# CPU example's 1M-parameter model sharding cost more time than the model's own matmuls).
REPLICATE_BELOW_PARAMS = 16_000_000


def _replicates(fsdp: FSDPEngineConfig, module) -> bool:
    """Whether the FSDP config `fsdp` leaves the layout to us (fsdp_size=-1) and `module` is small."""
    return fsdp.fsdp_size == -1 and sum(p.numel() for p in module.parameters()) < REPLICATE_BELOW_PARAMS


def _auto_replicate(fsdp: FSDPEngineConfig, module) -> FSDPEngineConfig:
    """`fsdp` with fsdp_size=1 when it asks for -1 (all ranks) and `module` is small; else as given."""
    return dataclasses.replace(fsdp, fsdp_size=1) if _replicates(fsdp, module) else fsdp


def _trains_as_plain_replicas(fsdp_cfg, module) -> bool:
    """Whether `module` is replicated without FSDP (`verl.workers.dp_training.replicate_over_ranks`).

    That is the case `_auto_replicate` replicates (`_replicates`: fsdp_size=-1 and a small model),
    as long as FSDP2 would not change how it computes: no FSDP CPU offload and no mixed-precision cast (the
    parameter dtype of `fsdp_config.mixed_precision` or `fsdp_config.dtype` is the model's own). A replicated model under FSDP2 still pays its per-layer hooks, per-layer
    all-reduces and DTensor dispatch on every op: on the CPU example (1M parameters, 2 gloo ranks,
    96 rows per rank) an update took 170 ms under FSDP2 and 125-133 ms as plain replicas.
    """
    from verl.utils.fsdp_utils import get_mixed_precision_policy

    fsdp = fsdp_engine_config(fsdp_cfg)
    if not _replicates(fsdp, module) or fsdp.offload_policy:
        return False
    param_dtype = get_mixed_precision_policy(fsdp.mixed_precision, fsdp.dtype).param_dtype
    return param_dtype is None or all(p.dtype == param_dtype for p in module.parameters())


class _OptimizedModel(_FSDPModel):
    """An FSDP model with its AdamW optimizer, LR schedule and checkpoint manager."""

    def __init__(self, model_cfg, fsdp_cfg, optim_cfg, checkpoint_cfg, tokenizer, value_head: bool = False):
        super().__init__(model_cfg, fsdp_cfg, for_training=True, value_head=value_head)
        from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager
        from verl.utils.optim import build_lr_scheduler, build_optimizer

        # with LoRA only the adapters require gradients: AdamW state for them alone
        self.optimizer = build_optimizer([p for p in self.module.parameters() if p.requires_grad], optim_cfg)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, optim_cfg)
        self.checkpoint_manager = FSDPCheckpointManager(
            model=self.module,
            optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler,
            processing_class=tokenizer,
            checkpoint_config=checkpoint_cfg,
        )

    def step_scheduler(self) -> float:
        lr = self.lr_scheduler.get_last_lr()[0]
        self.lr_scheduler.step()
        return lr

    def save(self, local_path: str, global_step: int, max_ckpt_to_keep: int | None) -> None:
        with self.on_device(optimizer=True):  # the checkpoint manager reads state on the device
            self.checkpoint_manager.save_checkpoint(
                local_path, global_step=global_step, max_ckpt_to_keep=max_ckpt_to_keep
            )

    def load(self, local_path: str) -> None:
        with self.on_device(optimizer=True):
            self.checkpoint_manager.load_checkpoint(local_path)


class _PendingWeights:
    """A rollout-only worker's `WeightRefresh` for partial rollouts (see `HFRollout`): newer weights are
    pending once the trainer has announced a version newer than the one this worker holds."""

    def __init__(self, worker: ActorRolloutRefWorker):
        self.worker = worker

    @property
    def version(self) -> int:
        return self.worker.weight_version

    def pending(self) -> bool:
        latest = self.worker._weight_receiver.latest_version()
        received = self.worker._received_version
        return latest is not None and (received is None or latest > received)

    def load(self) -> int:
        self.worker._load_weight_version(self.worker._weight_receiver.latest_version())
        return self.version


class ActorRolloutRefWorker(Worker, DistProfilerExtension):
    """Actor (FSDP2 training), rollout (generation engine) and reference policy, in any combination.

    Another training backend (`verl.workers.megatron_workers`) subclasses it: it overrides the
    hooks `_data_parallel_size` (its own process layout), `_build_actor`, `_build_ref` and
    `_builds_engine`, and registers the data RPCs with its own dispatch; the RPC bodies are shared.
    """

    def __init__(
        self, config: DictConfig, role: str, project_name: str | None = None, experiment_name: str | None = None
    ):
        super().__init__()
        # the trainer's names, for the agent-loop rollout's traces (this config is actor_rollout_ref only)
        self.trace_names = {"project_name": project_name, "experiment_name": experiment_name}
        if role not in _ROLES:
            raise ValueError(f"unknown worker role {role!r}; valid roles: {sorted(_ROLES)}")
        self.config = config
        self.role = role
        self.parts = _ROLES[role]
        os.environ["VERL_ROLE"] = role
        _join_group(self, config.get("nccl_timeout"))
        # the profiler section of the part this worker trains or runs first (upstream's choice)
        profiled = next(part for part in ("actor", "rollout", "ref") if part in self.parts)
        self.init_profiler(self.rank, (config.get(profiled) or {}).get("profiler"), role)
        self.ulysses = _actor_ulysses_rows(config)
        self.dp_size = self._data_parallel_size() // self.ulysses.sp
        with open_dict(self.config):  # the actor's own key (upstream's dp_actor) follows the model's by default
            remove_padding = self.config.actor.get("use_remove_padding")
            if remove_padding is None:
                remove_padding = self.config.model.get("use_remove_padding", False)
            self.config.actor.use_remove_padding = bool(remove_padding)
        if "actor" in self.parts:
            _normalize_batch_sizes(self.config.actor, self.config.rollout.n, self.dp_size)
        self.actor = self.rollout = self.ref = None
        # Asynchronous training (separate pools): the weight version a rollout-only worker holds,
        # stamped on every sample it generates; None in the hybrid engine (always current weights).
        self.weight_version: int | None = 0 if self.parts == ("rollout",) else None
        self._weight_sync_store = self._weight_sender = self._weight_receiver = None
        # The last version taken from the weight-sync group: every version sent must be taken once
        # (its buckets are collectives), by receive_weights or mid-generation by a partial rollout.
        self._received_version: int | None = None

    def _need(self, part: str, method: str):
        if part not in self.parts:
            raise RuntimeError(f"{method} needs the {part} part, but this worker has role {self.role!r}")
        return getattr(self, part)

    # ------------------------------------------------------------ backend hooks
    def _data_parallel_size(self) -> int:
        """Ranks holding different data (FSDP: every rank)."""
        return dist.get_world_size()

    def _build_actor(self):
        """(model holder, actor) of the trained policy."""
        from verl.workers.actor.dp_actor import DataParallelPPOActor

        cfg = self.config
        model = _OptimizedModel(
            cfg.model, cfg.actor.get("fsdp_config"), cfg.actor.optim, cfg.actor.get("checkpoint"), self.tokenizer
        )
        return model, DataParallelPPOActor(cfg.actor, model.module, model.optimizer, ulysses_group=self.ulysses.group)

    def _build_ref(self):
        """(model holder, log-prob scorer) of the frozen reference policy."""
        from verl.workers.actor.dp_actor import DataParallelPPOActor

        cfg = self.config
        if self.actor is not None and self.actor_model.lora:
            # the frozen base under the adapters is the initial policy: no second copy of the weights
            model = self.actor_model
        else:
            model = _FSDPModel(cfg.model, (cfg.get("ref") or {}).get("fsdp_config"), for_training=False)
        # Only compute_log_prob is used, which reads the actor's model-side keys (remove padding, ...).
        return model, DataParallelPPOActor(cfg.actor, model.module, ulysses_group=self.ulysses.group)

    def _builds_engine(self) -> bool:
        """Whether this rank holds a generation engine (FSDP: every rank generates its own chunk)."""
        return True

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        from verl.utils.tokenizer import hf_tokenizer

        cfg = self.config
        self.tokenizer = hf_tokenizer(cfg.model.get("tokenizer_path") or cfg.model.path)
        if "actor" in self.parts:
            self.actor_model, self.actor = self._build_actor()
        if "rollout" in self.parts and self._builds_engine():
            from verl.workers.rollout import get_rollout_class
            from verl.workers.rollout.base import runs_agent_loops

            rollout_cls = get_rollout_class(cfg.rollout.name)
            self.rollout = rollout_cls(cfg.model.path, config=cfg.rollout, tokenizer=self.tokenizer)
            if runs_agent_loops(cfg.rollout):
                from verl.experimental.agent_loop import AgentLoopRollout

                # agent loops (tool calls, or the loops a config file registers) over the same engine;
                # weight sync and sleep pass through
                self.rollout = AgentLoopRollout(self.rollout, cfg.rollout, self.tokenizer, **self.trace_names)
            if self.actor is not None:
                self.rollout.sleep()  # weights arrive from the actor before each generation
        if "ref" in self.parts:
            self.ref_model, self.ref = self._build_ref()
        _seed_sampling()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def speed_paths(self) -> list[dict]:
        """This rank's speed paths (`verl.utils.speed_paths`) as dicts: the actor's and reference's
        shared-prompt forward, remove padding and fused kernels, and the rollout engine's."""
        paths = []
        for part in (self.actor, self.ref):
            if part is None:
                continue
            shared = getattr(part, "shared_prompt_path", None)
            if shared is None:
                requested = bool(self.config.actor.get("share_prompt_forward", True))
                shared = SpeedPath(
                    "shared_prompt_forward", requested, False, f"{type(part).__name__} has no shared-prompt forward"
                )
            paths += [shared, *_model_speed_paths(self.config.model, part, self.config.get("actor"))]
        if self.rollout is not None:
            paths += self.rollout.speed_paths()
        return [path.to_dict() for path in merge_speed_paths(paths)]

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    @DistProfiler.annotate("generate_sequences")
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Sync weights into the engine (hybrid engine), generate, then put the engine to sleep.

        A rank without an engine (see `_builds_engine`) takes part in the weight gather, a
        collective, and returns an empty DataProto, which its dispatch mode does not collect."""
        rollout = self._need("rollout", "generate_sequences")
        metrics = {}
        if self.actor is not None:
            start = time.perf_counter()
            sync_rollout_weights(self.actor_model, rollout, rollout_dtype(self.config.rollout))
            metrics["timing_s/update_weights"] = time.perf_counter() - start
        if rollout is None:
            return DataProto()
        start = time.perf_counter()
        output = rollout.generate_sequences(prompts)
        metrics["timing_s/generate_sequences"] = time.perf_counter() - start
        if self.actor is not None and self.config.rollout.get("free_cache_engine", True):
            rollout.sleep()
        output.meta_info["metrics"] = {**output.meta_info.get("metrics", {}), **metrics}
        if self.weight_version is not None and "weight_version" not in output.non_tensor_batch:
            import numpy as np

            # one version for the whole request (a partial rollout sets each row's oldest and newest itself)
            for key in ("weight_version", "weight_version_max"):
                output.non_tensor_batch[key] = np.full(len(output), self.weight_version, dtype=np.int64)
        dev.empty_cache()
        return output

    # ---------------------------------------------- weight transfer between separate pools (async training)
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def host_weight_sync(self, timeout_s: float) -> tuple[str, int] | None:
        """Actor rank 0 hosts the weight-sync rendezvous store: returns its (host, port); None elsewhere."""
        self._need("actor", "host_weight_sync")
        if self.rank != 0:
            return None
        from verl.workers.weight_sync import host_weight_sync_store

        self._weight_sync_store, host, port = host_weight_sync_store(timeout_s)
        return host, port

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def init_weight_sync(self, host: str, port: int, world_size: int, timeout_s: float, bucket_megabytes: int) -> None:
        """Join the trainer->rollout weight-sync group: actor rank 0 as sender (group rank 0), rollout
        rank r as receiver r + 1. Both pools must call it concurrently (the rendezvous waits for all)."""
        from verl.workers.weight_sync import WeightReceiver, WeightSender, connect_store

        if self.actor is not None:
            if self.rank == 0:
                self._weight_sender = WeightSender(
                    self._weight_sync_store, world_size, timeout_s, bucket_bytes=int(bucket_megabytes) << 20
                )
            return
        self._need("rollout", "init_weight_sync")
        store = connect_store(host, port, timeout_s)
        self._weight_receiver = WeightReceiver(store, self.rank + 1, world_size, timeout_s)
        self.rollout.weight_refresh = _PendingWeights(self)  # engines without partial rollouts ignore it

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def send_weights(self, version: int) -> dict[str, float]:
        """Gather the full weights (every actor rank takes part) and start broadcasting them from rank 0
        in the background; returns once rank 0 holds its copy, so the next update can start."""
        self._need("actor", "send_weights")
        start = time.perf_counter()
        with self.actor_model.on_device():  # pack() copies the weights: the background send needs no params
            # cast to what the rollout engines hold before gathering: rank 0 keeps a bf16 copy, not fp32
            params = self.actor_model.hf_params(rollout_dtype(self.config.rollout))
            if self._weight_sender is None:
                for _ in params:  # the gathers are collectives: every rank iterates to the end
                    pass
            else:
                self._weight_sender.send_async(version, self._weight_sender.pack(params))
        return {"timing_s/gather_weights": time.perf_counter() - start}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def receive_weights(self, version: int) -> dict[str, float]:
        """Load weight `version` from the trainer into this rollout engine; later samples carry it.
        A no-op when a partial rollout already took this version in the middle of a generation."""
        self._need("rollout", "receive_weights")
        if self._weight_receiver is None:
            raise RuntimeError("receive_weights before init_weight_sync: the weight-sync group does not exist yet")
        if self._received_version is not None and self._received_version >= version:
            return {}
        start = time.perf_counter()
        self._load_weight_version(int(version))
        return {"timing_s/receive_weights": time.perf_counter() - start}

    def _load_weight_version(self, version: int) -> None:
        self.rollout.update_weights(self._weight_receiver.receive(version))
        self.weight_version = self._received_version = version

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    @DistProfiler.annotate("compute_log_prob")
    def compute_log_prob(self, data: DataProto) -> DataProto:
        actor = self._need("actor", "compute_log_prob")
        data = self.ulysses.gather(data)
        _log_prob_meta(data, self.config.rollout, self.config.rollout.temperature)
        # the optimal token baseline needs sum_v pi_v^2 per token (actor.calculate_sum_pi_squared)
        stats = ("entropy", "sum_pi_squared") if self.config.actor.get("calculate_sum_pi_squared") else ("entropy",)
        with self.actor_model.on_device():
            log_probs, values = actor.compute_log_prob_and_stats(data, stats)
        tensors = {"old_log_probs": log_probs, "entropys": values["entropy"]}
        if "sum_pi_squared" in values:
            tensors["sum_pi_squared"] = values["sum_pi_squared"]
        return self.ulysses.own(DataProto.from_dict(tensors=tensors))

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    @DistProfiler.annotate("compute_ref_log_prob")
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        ref = self._need("ref", "compute_ref_log_prob")
        data = self.ulysses.gather(data)
        _log_prob_meta(data, self.config.get("ref", {}) or self.config.rollout, self.config.rollout.temperature)
        with self.ref_model.on_device(), self.ref_model.adapters_disabled():
            log_probs, _ = ref.compute_log_prob(data, calculate_entropy=False)
        return self.ulysses.own(DataProto.from_dict(tensors={"ref_log_prob": log_probs}))

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    @DistProfiler.annotate("update_actor")
    def update_actor(self, data: DataProto) -> DataProto:
        actor = self._need("actor", "update_actor")
        data = self.ulysses.gather(data)
        data.meta_info.setdefault("temperature", self.config.rollout.temperature)
        start = time.perf_counter()
        with self.actor_model.on_device(optimizer=True), _device_timer() as compute_s:
            metrics = actor.update_policy(data)
        metrics["actor/lr"] = self.actor_model.step_scheduler()
        metrics["perf/update_actor_s"] = time.perf_counter() - start  # with the offload transfers
        # MFU: the FLOPs the update ran over its synchronised compute time, offload excluded
        actor_mfu = _mfu_metric(actor.flops.total(), compute_s[0], self.dp_size)
        if actor_mfu is not None:
            metrics["perf/mfu/actor"] = actor_mfu
        mem = dev.memory_stats()
        for key in ("max_allocated_gb", "cpu_rss_gb"):
            if key in mem:
                metrics[f"perf/{'max_memory_allocated_gb' if key == 'max_allocated_gb' else key}"] = mem[key]
        return DataProto(meta_info={"metrics": metrics})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, local_path: str, global_step: int = 0, max_ckpt_to_keep: int | None = None) -> None:
        self._need("actor", "save_checkpoint")
        self.actor_model.save(local_path, global_step, max_ckpt_to_keep)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, local_path: str, del_local_after_load: bool = False) -> None:
        self._need("actor", "load_checkpoint")
        self.actor_model.load(local_path)


class CriticWorker(Worker, DistProfilerExtension):
    """The value model (an LM body with a one-output token head), trained with the clipped value loss.

    Hooks for another backend, as in `ActorRolloutRefWorker`: `_data_parallel_size`, `_build_critic`."""

    def __init__(self, config: DictConfig):
        super().__init__()
        self.config = config
        os.environ["VERL_ROLE"] = "critic"
        _join_group(self, config.get("nccl_timeout"))
        self.init_profiler(self.rank, config.get("profiler"), "critic")
        self.ulysses = UlyssesRows(int(config.get(SP_KEY, 1) or 1), "critic")
        self.dp_size = dp = self._data_parallel_size() // self.ulysses.sp
        with open_dict(self.config):
            scale_token_budgets(self.config, _CRITIC_TOKEN_BUDGETS, self.ulysses.sp)
            n = config.get("rollout_n", 1)
            self.config.ppo_mini_batch_size = config.ppo_mini_batch_size * n // dp
            self.config.use_remove_padding = config.model.get("use_remove_padding", False)

    def _data_parallel_size(self) -> int:
        return dist.get_world_size()

    def _build_critic(self):
        """(model holder, critic) of the value model."""
        from verl.workers.critic.dp_critic import DataParallelPPOCritic

        cfg = self.config
        model = _OptimizedModel(
            cfg.model, cfg.model.get("fsdp_config"), cfg.optim, cfg.get("checkpoint"), self.tokenizer, value_head=True
        )
        return model, DataParallelPPOCritic(cfg, model.module, model.optimizer, ulysses_group=self.ulysses.group)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        from verl.utils.tokenizer import hf_tokenizer

        cfg = self.config
        self.tokenizer = hf_tokenizer(cfg.model.get("tokenizer_path") or cfg.model.path)
        self.critic_model, self.critic = self._build_critic()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def speed_paths(self) -> list[dict]:
        """This rank's speed paths (`verl.utils.speed_paths`) as dicts: the critic's remove padding and fused kernels."""
        return [path.to_dict() for path in _model_speed_paths(self.config.model, self.critic)]

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    @DistProfiler.annotate("compute_values")
    def compute_values(self, data: DataProto) -> DataProto:
        data = self.ulysses.gather(data)
        micro = self.config.get("forward_micro_batch_size_per_gpu") or self.config.get("ppo_micro_batch_size_per_gpu")
        data.meta_info.setdefault("micro_batch_size", micro or len(data))
        data.meta_info.setdefault("use_dynamic_bsz", self.config.get("use_dynamic_bsz", False))
        data.meta_info.setdefault("max_token_len", self.config.get("forward_max_token_len_per_gpu", 16384))
        with self.critic_model.on_device():
            values = self.critic.compute_values(data)
        return self.ulysses.own(DataProto.from_dict(tensors={"values": values}))

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    @DistProfiler.annotate("update_critic")
    def update_critic(self, data: DataProto) -> DataProto:
        data = self.ulysses.gather(data)
        with self.critic_model.on_device(optimizer=True), _device_timer() as compute_s:
            metrics = self.critic.update_critic(data)
        metrics["critic/lr"] = self.critic_model.step_scheduler()
        critic_mfu = _mfu_metric(self.critic.flops.total(), compute_s[0], self.dp_size)
        if critic_mfu is not None:
            metrics["perf/mfu/critic"] = critic_mfu
        return DataProto(meta_info={"metrics": metrics})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, local_path: str, global_step: int = 0, max_ckpt_to_keep: int | None = None) -> None:
        self.critic_model.save(local_path, global_step, max_ckpt_to_keep)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, local_path: str, del_local_after_load: bool = False) -> None:
        self.critic_model.load(local_path)


def _keep_last_tokens(input_ids: torch.Tensor, attention_mask: torch.Tensor, max_length: int, pad_id: int):
    """Each row's last `max_length` real tokens (the end of the response, which the score judges,
    survives; the start of the prompt goes), right-padded with `pad_id` to the longest kept row."""
    rows = [ids[mask.bool()][-max_length:] for ids, mask in zip(input_ids, attention_mask, strict=True)]
    width = max(len(r) for r in rows)
    out_ids = torch.full((len(rows), width), pad_id, dtype=input_ids.dtype)
    out_mask = torch.zeros((len(rows), width), dtype=attention_mask.dtype)
    for i, row in enumerate(rows):
        out_ids[i, : len(row)] = row
        out_mask[i, : len(row)] = 1
    return out_ids, out_mask


def _same_tokenizer(a, b) -> bool:
    """Whether two HF tokenizers turn every chat into the same ids (same vocabulary, special tokens and
    chat template)."""
    return (
        a.get_vocab() == b.get_vocab()
        and a.all_special_tokens == b.all_special_tokens
        and getattr(a, "chat_template", None) == getattr(b, "chat_template", None)
    )


class RewardModelWorker(Worker, DistProfilerExtension):
    """Scores responses with a sequence-classification model; re-tokenises when its tokenizer differs."""

    def __init__(self, config: DictConfig):
        super().__init__()
        self.config = config
        os.environ["VERL_ROLE"] = "reward_model"
        _join_group(self, config.get("nccl_timeout"))
        self.init_profiler(self.rank, config.get("profiler"), "reward_model")

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        from transformers import AutoModelForSequenceClassification

        model_cfg = self.config.model
        # bf16 on GPU, as upstream loads its reward model (an fp32 forward runs at a fraction of the
        # tensor cores' rate); fp32 on CPU
        self.model = AutoModelForSequenceClassification.from_pretrained(
            model_cfg.path,
            num_labels=1,
            trust_remote_code=model_cfg.get("trust_remote_code", False),
            dtype=dev.default_compute_dtype(),
        )
        self.model.to(dev.get_device()).eval()
        self._load_tokenizers()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def speed_paths(self) -> list[dict]:
        """This rank's speed paths (`verl.utils.speed_paths`) as dicts: the reward model runs padded
        rows, unfused (its `use_remove_padding` and `use_fused_kernels` are accepted for upstream configs)."""
        return [path.to_dict() for path in _model_speed_paths(self.config.model, self)]

    def _load_tokenizers(self) -> None:
        """The reward model's tokenizer, and the policy's when responses must be re-tokenised: only
        when `model.input_tokenizer` is set and differs from the reward model's (vocabulary or chat
        template); with the same tokenizer the policy's token ids are already the model's input."""
        from verl.utils.tokenizer import hf_tokenizer

        model_cfg = self.config.model
        self.rm_tokenizer = hf_tokenizer(model_cfg.path)
        input_tok = model_cfg.get("input_tokenizer")
        self.input_tokenizer = hf_tokenizer(input_tok) if input_tok else None
        if self.input_tokenizer is not None and _same_tokenizer(self.input_tokenizer, self.rm_tokenizer):
            self.input_tokenizer = None

    def _rm_inputs(self, data: DataProto) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids for the reward model (the policy's ids as they are, or re-tokenised chat text),
        each row cut to its last `reward_model.max_length` tokens when it is longer."""
        input_ids, attention_mask = self._rm_tokens(data)
        max_length = self.config.get("max_length")
        if max_length and int(attention_mask.sum(-1).max()) > int(max_length):
            input_ids, attention_mask = _keep_last_tokens(input_ids, attention_mask, int(max_length), self._pad_id())
        return input_ids, attention_mask

    def _pad_id(self) -> int:
        pad = self.rm_tokenizer.pad_token_id
        return pad if pad is not None else (self.rm_tokenizer.eos_token_id or 0)

    def _rm_tokens(self, data: DataProto) -> tuple[torch.Tensor, torch.Tensor]:
        if self.input_tokenizer is None:
            return data.batch["input_ids"], data.batch["attention_mask"]
        if "raw_prompt" not in data.non_tensor_batch:
            raise ValueError(
                "the reward model's tokenizer differs from the policy's (reward_model.model.input_tokenizer), so "
                "its inputs are re-rendered from the prompt messages, but the batch has no 'raw_prompt'; set "
                "data.return_raw_chat=true (main_ppo does when a reward model is enabled)"
            )
        texts = []
        responses = data.batch["responses"]
        response_mask = data.batch["response_mask"]
        for i in range(len(data)):
            response = self.input_tokenizer.decode(responses[i][response_mask[i].bool()], skip_special_tokens=True)
            chat = list(data.non_tensor_batch["raw_prompt"][i]) + [{"role": "assistant", "content": response}]
            texts.append(self.rm_tokenizer.apply_chat_template(chat, tokenize=False))
        enc = self.rm_tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        return enc["input_ids"], enc["attention_mask"]

    def _sequence_scores(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """One score per row [B] (float32, CPU): the classifier's output at its pooled token."""
        micro = self.config.get("micro_batch_size_per_gpu") or len(input_ids)
        scores = []
        with torch.no_grad():
            for start in range(0, len(input_ids), micro):
                ids = input_ids[start : start + micro].to(dev.get_device())
                mask = attention_mask[start : start + micro].to(dev.get_device())
                position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
                logits = self.model(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits
                # [rows, num_labels]: the last (with one label, the only) output; a 1-row batch keeps its row
                scores.append(logits.float().reshape(len(ids), -1)[:, -1].cpu())
        return torch.cat(scores).reshape(-1)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    @DistProfiler.annotate("compute_rm_score")
    def compute_rm_score(self, data: DataProto) -> DataProto:
        seq_scores = self._sequence_scores(*self._rm_inputs(data))
        # The score sits on the last valid response token, like a rule reward.
        response_mask = data.batch["response_mask"]
        last = (response_mask.sum(-1) - 1).clamp(min=0)
        rm_scores = torch.zeros_like(response_mask, dtype=torch.float32)
        rm_scores[torch.arange(len(data)), last] = seq_scores
        return DataProto.from_dict(tensors={"rm_scores": rm_scores})
