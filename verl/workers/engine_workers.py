"""The Ray-facing role workers, written once on the training-engine interface (`verl.workers.engine`).

`ActorRolloutRefWorker`, `CriticWorker` and `RewardModelWorker` here hold every RPC body; a
backend's module (`verl.workers.fsdp_workers`, `verl.workers.megatron_workers`) names its
`strategy` (the `EngineRegistry` key), builds its actor/critic around the engine, and registers
the data RPCs with its dispatch. The trainer never learns which backend it drives.

`ActorRolloutRefWorker(config, role)` is built by composition: the role string decides once, in
`__init__`, which of three parts exist: the actor (an engine with optimizer, lr schedule and
checkpoints, and the actor logic around it), the rollout (the generation engine, fed weights from
the actor before each generation and put to sleep afterwards: the hybrid engine) and the
reference (a frozen engine, or with LoRA the actor's own engine with its adapters off). Every RPC
delegates to its part; calling an RPC whose part this role lacks is a clear error.

A backend with model parallelism (megatron) returns each data-parallel replica's results from one
rank (`BaseEngine.is_mp_src_rank_with_outputs`); only that rank builds a generation engine, the
others of the replica take part in the weight gather (a collective) and return nothing.

Batch-size normalisation follows upstream: `ppo_mini_batch_size` counts prompts, so it is
multiplied by `rollout.n` and divided by the data-parallel size; `*_micro_batch_size_per_gpu` is
already per rank.

Each config section is built into its typed class (`verl.workers.config`) once, in `__init__`, after the
per-rank normalisation above, and read by attribute from then on (`actor_config`, `ref_config`,
`rollout_config`, `model_config`; a critic's `critic_config`): the defaults live in the dataclasses, not
beside each read. The rollout engine and the agent loop still receive the rollout's DictConfig section
(their code converts it where it is received). The reward model's section has no workers-layer class
(its schema lives with the trainer's), so that worker reads its DictConfig by attribute.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from typing import TYPE_CHECKING

import torch
from omegaconf import DictConfig, open_dict

from verl.protocol import DataProto
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register
from verl.utils import device as dev
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.logging_utils import get_logger
from verl.utils.profiler import DistProfiler, DistProfilerExtension
from verl.utils.speed_paths import SpeedPath, model_speed_paths
from verl.utils.speed_paths import merge as merge_speed_paths
from verl.utils.ulysses_keys import reference_sp, role_sp
from verl.workers.config import ActorConfig, CriticConfig, HFModelConfig, RefConfig, RolloutConfig, TrainingWorkerConfig  # noqa: F401
from verl.workers.engine import BaseEngine, EngineRegistry
from verl.workers.group_setup import _join_group, _seed_sampling
from verl.workers.rollout_weights import PendingWeights, rollout_dtype, sync_rollout_weights
from verl.workers.training_worker import TrainingWorker  # noqa: F401  (upstream's import path)
from verl.workers.ulysses_rows import UlyssesRows, scale_token_budgets

if TYPE_CHECKING:
    from verl.workers.rollout.wrapper import RolloutWrapper

logger = get_logger(__name__)

_ROLES = {
    "actor": ("actor",),
    "rollout": ("rollout",),
    "ref": ("ref",),
    "actor_rollout": ("actor", "rollout"),
    "actor_rollout_ref": ("actor", "rollout", "ref"),
}


def _normalize_batch_sizes(actor_cfg: ActorConfig, rollout_n: int, dp_size: int) -> ActorConfig:
    """`actor_cfg` with its prompt-counted mini-batch turned into this rank's sample count (a copy:
    sections are frozen), with errors that say how to fix."""
    global_mini = actor_cfg.ppo_mini_batch_size * rollout_n
    if global_mini % dp_size:
        raise ValueError(
            f"actor.ppo_mini_batch_size={actor_cfg.ppo_mini_batch_size} x rollout.n={rollout_n} = {global_mini} "
            f"samples is not divisible by the {dp_size} data-parallel ranks; choose a mini-batch size "
            f"so that the product is a multiple of {dp_size}"
        )
    per_rank = global_mini // dp_size
    micro = actor_cfg.ppo_micro_batch_size_per_gpu
    if not actor_cfg.use_dynamic_bsz and micro and micro < per_rank and per_rank % micro:
        raise ValueError(
            f"the per-rank mini-batch of {per_rank} samples is not divisible by "
            f"actor.ppo_micro_batch_size_per_gpu={micro}; pick a micro-batch size that divides it"
        )
    return dataclasses.replace(actor_cfg, ppo_mini_batch_size=per_rank)


# per-rank token budgets that count tokens per micro-batch: with sp > 1 a rank holds 1/sp of them
_CRITIC_TOKEN_BUDGETS = ("ppo_max_token_len_per_gpu", "forward_max_token_len_per_gpu")


def _actor_ulysses_rows(config: DictConfig) -> UlyssesRows:
    """The actor's (and reference's) dp x sp layout; the reference runs with the actor's size
    (`verl.utils.ulysses.reference_sp`, either spelling of the key). Scales the raw sections' per-rank
    token budgets in place, before they are built into their classes."""
    sp = reference_sp(config.actor, config.ref if "ref" in config else None)
    rows = UlyssesRows(sp, role_sp(config.actor, "actor_rollout_ref.actor")[1])
    with open_dict(config):
        scale_token_budgets(config.actor, ("ppo_max_token_len_per_gpu",), rows.sp)
        for part in ("rollout", "ref"):
            if part in config:
                scale_token_budgets(config[part], ("log_prob_max_token_len_per_gpu",), rows.sp)
    return rows


def _log_prob_meta(data: DataProto, cfg: RefConfig | RolloutConfig, temperature: float) -> None:
    """The forward micro-batching of a log-prob pass, from the section that owns it (`ref` or `rollout`)."""
    data.meta_info.setdefault("micro_batch_size", cfg.log_prob_micro_batch_size_per_gpu or len(data))
    data.meta_info.setdefault("use_dynamic_bsz", cfg.log_prob_use_dynamic_bsz)
    data.meta_info.setdefault("max_token_len", cfg.log_prob_max_token_len_per_gpu)
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


def _policy_asks_for_fused_kernels(model: HFModelConfig, actor: ActorConfig) -> bool:
    """Whether the policy's sections ask for fused kernels: the model's `use_fused_kernels` or `use_liger`,
    or the actor's `use_fused_kernels` alone (upstream's YAML copies the model's there; a user may set only it)."""
    return model.use_fused_kernels or model.use_liger or actor.use_fused_kernels


def policy_uses_fused_kernels(model: HFModelConfig, actor: ActorConfig) -> bool:
    """Whether the actor and reference take the fused log-prob path (`verl.utils.experimental.torch_functional`):
    the model's or the actor's `use_fused_kernels`, with a backend this project implements (else a ValueError)."""
    from verl.utils.experimental.torch_functional import check_fused_backend

    fused = bool(model.use_fused_kernels or actor.use_fused_kernels)
    if fused:
        check_fused_backend(model.fused_kernel_options)
    return fused


class ActorRolloutRefWorker(Worker, DistProfilerExtension):
    """Actor (training engine), rollout (generation engine) and reference policy, in any combination.

    A backend's subclass sets `strategy` (its engines' `EngineRegistry` key) and implements
    `_actor_engine_config`, `_ref_engine_config` and `_make_actor`; one with model parallelism also
    re-registers the data RPCs with its own dispatch (`_register_outputs` says which rank returns them).
    """

    strategy: str = ""
    """The training backend: the `EngineRegistry` key of this worker's engines."""

    def __init__(
        self,
        config: DictConfig,
        role: str,
        project_name: str | None = None,
        experiment_name: str | None = None,
        rollout_wrapper: RolloutWrapper | None = None,
    ):
        super().__init__()
        # the trainer's names, for the agent-loop rollout's traces (this config is actor_rollout_ref only)
        self.trace_names = trace_run_names(config, project_name, experiment_name)
        # what runs agent loops over the rollout engine, passed in from above (verl.workers.rollout.wrapper)
        self.rollout_wrapper = rollout_wrapper
        if role not in _ROLES:
            raise ValueError(f"unknown worker role {role!r}; valid roles: {sorted(_ROLES)}")
        self.config = config
        self.role = role
        self.parts = _ROLES[role]
        os.environ["VERL_ROLE"] = role
        _join_group(self, config.nccl_timeout)
        self.ulysses = _actor_ulysses_rows(config)  # scales the raw sections' token budgets: before they are built
        self.model_config = omega_conf_to_dataclass(config.model, HFModelConfig)
        self.actor_config = omega_conf_to_dataclass(config.actor, ActorConfig)
        self.rollout_config = omega_conf_to_dataclass(config.rollout, RolloutConfig)
        self.ref_config = omega_conf_to_dataclass(config.ref, RefConfig) if "ref" in config else RefConfig()
        # the profiler section of the part this worker trains or runs first (upstream's choice); the
        # rollout section has none (upstream's rollout profiles through its engine's own tools)
        profiled = next(part for part in ("actor", "rollout", "ref") if part in self.parts)
        profiler = {"actor": self.actor_config.profiler, "rollout": None, "ref": self.ref_config.profiler}[profiled]
        self.init_profiler(self.rank, profiler, role)
        self.dp_size = self._data_parallel_size() // self.ulysses.sp
        if "actor" in self.parts:
            self.actor_config = _normalize_batch_sizes(self.actor_config, self.rollout_config.n, self.dp_size)
            # upstream's workers normalise the section in place: a recipe's init_model builds its actor
            # from `self.config.actor` (upstream's worker internals, below), which must hold this rank's mini-batch too
            with open_dict(config):
                config.actor.ppo_mini_batch_size = self.actor_config.ppo_mini_batch_size
        self.actor = self.rollout = self.ref = None
        self.rollout_metrics = None  # the engine's Prometheus endpoint (rollout.prometheus.enable)
        # Asynchronous training (separate pools): the weight version a rollout-only worker holds,
        # stamped on every sample it generates; None in the hybrid engine (always current weights).
        self.weight_version: int | None = 0 if self.parts == ("rollout",) else None
        self._weight_sync_store = self._weight_sender = self._weight_receiver = None
        # The last version taken from the weight-sync group: every version sent must be taken once
        # (its buckets are collectives), by receive_weights or mid-generation by a partial rollout.
        self._received_version: int | None = None

    # ------------------------------------------------------------ upstream's worker internals
    # A recipe's worker that overrides init_model (verl-recipe's SPPO) reads these flags and sets
    # `self.actor`, `self.ref_policy`, `self.checkpoint_manager` itself; the RPCs below then run on what
    # it built (its engines come from the backend's `_build_model_optimizer`).
    @property
    def _is_actor(self) -> bool:
        return "actor" in self.parts

    @property
    def _is_rollout(self) -> bool:
        return "rollout" in self.parts

    @property
    def _is_ref(self) -> bool:
        return "ref" in self.parts

    @property
    def ref_policy(self):
        """Upstream's name of the reference policy's log-prob scorer (`self.ref` here)."""
        return self.ref

    @ref_policy.setter
    def ref_policy(self, value) -> None:
        self.ref = value

    def _adopt_checkpoint_manager(self) -> None:
        """A checkpoint manager a recipe's init_model built (`self.checkpoint_manager`, upstream's
        attribute) is the one the actor's engine saves and loads with."""
        manager = self.__dict__.get("checkpoint_manager")
        if manager is not None and getattr(self, "actor_model", None) is not None:
            self.actor_model.checkpoint_manager = manager

    def _need(self, part: str, method: str):
        if part not in self.parts:
            raise RuntimeError(f"{method} needs the {part} part, but this worker has role {self.role!r}")
        return getattr(self, part)

    # ------------------------------------------------------------ backend hooks
    def _actor_engine_config(self):
        """The actor's engine section (`fsdp_config`, `megatron`, ...) in this backend's place for it."""
        raise NotImplementedError(f"{type(self).__name__} names no actor engine section")

    def _ref_engine_config(self):
        """The reference policy's engine section."""
        raise NotImplementedError(f"{type(self).__name__} names no reference engine section")

    def _engine_options(self, role: str) -> dict:
        """Keyword arguments of this backend's engine for `role` (actor, ref) beyond the shared ones."""
        return {}

    def _make_actor(self, engine: BaseEngine, trains: bool):
        """The actor logic (log-probs, entropy, policy update) around `engine`; without `trains`, a
        log-prob scorer (the reference policy) that cannot update the weights."""
        raise NotImplementedError(f"{type(self).__name__} builds no actor")

    def _register_outputs(self) -> None:
        """Tell a mesh dispatch which rank returns each data-parallel replica's results (no-op: every rank)."""

    # ------------------------------------------------------------ engine-backed parts
    def _data_parallel_size(self) -> int:
        """Data-parallel replicas of this backend's layout (sets up its process groups)."""
        engine_cls = EngineRegistry.get_engine_cls("language_model", self.strategy)
        dp_size = engine_cls.init_parallel(self._actor_engine_config())
        self.is_collect = engine_cls.is_mp_src_rank_with_outputs()
        self._register_outputs()
        return dp_size

    def _build_actor(self):
        """(engine, actor) of the trained policy."""
        engine = EngineRegistry.new(
            "language_model",
            self.strategy,
            self.model_config,
            self._actor_engine_config(),
            self.actor_config.optim,
            self.actor_config.checkpoint,
            self.tokenizer,
            **self._engine_options("actor"),
        )
        return engine, self._make_actor(engine, trains=True)

    def _build_ref(self):
        """(engine, log-prob scorer) of the frozen reference policy."""
        if self.actor is not None and self.actor_model.lora:
            # the frozen base under the adapters is the initial policy: no second copy of the weights
            engine = self.actor_model
        else:
            engine = EngineRegistry.new(
                "language_model",
                self.strategy,
                self.model_config,
                self._ref_engine_config(),
                **self._engine_options("ref"),
            )
        # Only compute_log_prob is used, which reads the actor's model-side keys (remove padding, ...).
        return engine, self._make_actor(engine, trains=False)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        from verl.utils.import_utils import import_external_libs

        # model.external_lib: modules that register the model's classes with transformers, imported in
        # this process before anything loads the model (as upstream's workers do)
        import_external_libs(self.model_config.external_lib)
        self._load_tokenizer()
        if "actor" in self.parts:
            self.actor_model, self.actor = self._build_actor()
        if "rollout" in self.parts:
            self._build_rollout()
        if "ref" in self.parts:
            self.ref_model, self.ref = self._build_ref()
        _seed_sampling()

    def _load_tokenizer(self, model_path: str | None = None) -> None:
        """`self.tokenizer`: `model.tokenizer_path`, else `model_path` (default: `model.path`), with the
        model section's `custom_chat_template`."""
        from verl.utils.tokenizer import hf_tokenizer

        self.tokenizer = hf_tokenizer(
            self.model_config.tokenizer_path or model_path or self.model_config.path,
            chat_template=self.model_config.custom_chat_template,
        )

    def _build_rollout(self, trust_remote_code: bool = False) -> None:
        """The generation engine (`self.rollout`) on the ranks that run one (upstream's name; its
        `trust_remote_code` is the model section's here). Put to sleep when this worker trains the actor:
        its weights arrive from the actor before each generation."""
        del trust_remote_code  # the engine reads model.trust_remote_code
        cfg = self.config
        if self.is_collect:
            from verl.utils.model import model_dir_with_config
            from verl.workers.rollout import get_rollout_class
            from verl.workers.rollout.wrapper import wrap_rollout

            rollout_cls = get_rollout_class(cfg.rollout.name)
            # model.hf_config_path: the engine reads that config.json with the weights of model.path
            model_dir = model_dir_with_config(self.model_config.path, self.model_config.hf_config_path)
            engine = rollout_cls(model_dir, config=cfg.rollout, tokenizer=self.tokenizer)
            # agent loops (tool calls, or the loops a config file registers) over the same engine when the
            # config runs them; weight sync and sleep pass through
            self.rollout = wrap_rollout(
                engine,
                cfg.rollout,
                self.tokenizer,
                self.rollout_wrapper,
                **self.trace_names,
                trainer_config={"actor_rollout_ref": cfg},  # what upstream-style agent loops see as self.config
            )
            if self.actor is not None:
                self.rollout.sleep()  # weights arrive from the actor before each generation
            if self.rollout_config.prometheus.enable:
                from verl.workers.rollout.metrics_server import RolloutMetricsServer, served_model_name

                name = served_model_name(self.rollout_config.prometheus.served_model_name, cfg.model.path)
                self.rollout_metrics = RolloutMetricsServer(name, self.rollout_config.name)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def rollout_metrics_address(self) -> str | None:
        """`host:port` of this rank's rollout metrics endpoint (`rollout.prometheus.enable`), else None."""
        return None if self.rollout_metrics is None else self.rollout_metrics.address

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
                requested = self.actor_config.share_prompt_forward
                shared = SpeedPath(
                    "shared_prompt_forward", requested, False, f"{type(part).__name__} has no shared-prompt forward"
                )
            fused = _policy_asks_for_fused_kernels(self.model_config, self.actor_config)
            paths += [shared, *model_speed_paths(part, self.model_config.use_remove_padding, fused)]
        if self.rollout is not None:
            paths += self.rollout.speed_paths()
        return [path.to_dict() for path in merge_speed_paths(paths)]

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    @DistProfiler.annotate("generate_sequences")
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Sync weights into the engine (hybrid engine), generate, then put the engine to sleep.

        A rank without an engine (not `is_collect`) takes part in the weight gather, a
        collective, and returns an empty DataProto, which its dispatch mode does not collect."""
        rollout = self._need("rollout", "generate_sequences")
        metrics = {}
        if self.actor is not None:
            start = time.perf_counter()
            sync_rollout_weights(self.actor_model, rollout, rollout_dtype(self.rollout_config))
            metrics["timing_s/update_weights"] = time.perf_counter() - start
        if rollout is None:
            return DataProto()
        start = time.perf_counter()
        output = rollout.generate_sequences(prompts)
        metrics["timing_s/generate_sequences"] = time.perf_counter() - start
        if self.rollout_metrics is not None:
            self.rollout_metrics.observe(output, metrics["timing_s/generate_sequences"])
        if self.actor is not None and self.rollout_config.free_cache_engine:
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
        from verl.workers.weight_sync import WeightReceiver, WeightSender, connect_store, group_options

        group = group_options(self.rollout_config.checkpoint_engine)
        if self.actor is not None:
            if self.rank == 0:
                self._weight_sender = WeightSender(
                    self._weight_sync_store,
                    world_size,
                    timeout_s,
                    bucket_bytes=int(bucket_megabytes) << 20,
                    wire_dtype=self._weight_wire_dtype(),
                    **group,
                )
            return
        self._need("rollout", "init_weight_sync")
        store = connect_store(host, port, timeout_s)
        self._weight_receiver = WeightReceiver(store, self.rank + 1, world_size, timeout_s, **group)
        self.rollout.weight_refresh = PendingWeights(self)  # engines without partial rollouts ignore it

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def send_weights(self, version: int) -> dict[str, float]:
        """Gather the full weights (every actor rank takes part) and start broadcasting them from rank 0
        in the background; returns once rank 0 holds its copy, so the next update can start."""
        self._need("actor", "send_weights")
        start = time.perf_counter()
        with self.actor_model.on_device():  # pack() copies the weights: the background send needs no params
            # cast to what the rollout engines hold before gathering: rank 0 keeps a bf16 copy, not fp32
            params = self.actor_model.iter_hf_params(self._weight_wire_dtype() or rollout_dtype(self.rollout_config))
            if self._weight_sender is None:
                for _ in params:  # the gathers are collectives: every rank iterates to the end
                    pass
            else:
                self._weight_sender.send_async(version, self._weight_sender.pack(params))
        return {"timing_s/gather_weights": time.perf_counter() - start}

    def _weight_wire_dtype(self) -> torch.dtype | None:
        """`checkpoint_engine.engine_kwargs.nccl.rollout_dtype`: the dtype the weights are gathered and
        sent in (the rollout engine copies them into its own); None: the rollout's dtype."""
        from verl.workers.weight_sync import wire_dtype

        return wire_dtype(self.rollout_config.checkpoint_engine)

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
        _log_prob_meta(data, self.rollout_config, self.rollout_config.temperature)
        # the optimal token baseline needs sum_v pi_v^2 per token (an FSDP actor's calculate_sum_pi_squared)
        sum_pi_squared = "calculate_sum_pi_squared" in self.actor_config and self.actor_config.calculate_sum_pi_squared
        stats = ("entropy", "sum_pi_squared") if sum_pi_squared else ("entropy",)
        with self.actor_model.on_device():
            log_probs, values = actor.compute_log_prob_and_stats(data, stats)
        tensors = {"old_log_probs": log_probs, "entropys": values["entropy"]}
        if "sum_pi_squared" in values:
            tensors["sum_pi_squared"] = values["sum_pi_squared"]
        if "routed_experts" in values:  # the megatron actor's router replay (mode=R2) recorded them
            tensors["routed_experts"] = values["routed_experts"]
        return self.ulysses.own(DataProto.from_dict(tensors=tensors))

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    @DistProfiler.annotate("compute_ref_log_prob")
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        ref = self._need("ref", "compute_ref_log_prob")
        data = self.ulysses.gather(data)
        _log_prob_meta(data, self.ref_config, self.rollout_config.temperature)
        with self.ref_model.on_device(), self.ref_model.disable_adapter():
            log_probs, _ = ref.compute_log_prob(data, calculate_entropy=False)
        return self.ulysses.own(DataProto.from_dict(tensors={"ref_log_prob": log_probs}))

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    @DistProfiler.annotate("update_actor")
    def update_actor(self, data: DataProto) -> DataProto:
        actor = self._need("actor", "update_actor")
        data = self.ulysses.gather(data)
        data.meta_info.setdefault("temperature", self.rollout_config.temperature)
        start = time.perf_counter()
        actor.flops.reset()  # a recipe's update_policy (upstream's loop) does not reset the tally itself
        with self.actor_model.on_device(optimizer=True), _device_timer() as compute_s:
            metrics = actor.update_policy(data)
        metrics["actor/lr"] = self.actor_model.lr_scheduler_step()
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
        self._adopt_checkpoint_manager()
        self.actor_model.save_checkpoint(local_path, global_step, max_ckpt_to_keep)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def finish_checkpoint(self, wait: bool = True) -> bool:
        """Whether this rank's background checkpoint write is done (BaseEngine.finish_checkpoint)."""
        self._need("actor", "finish_checkpoint")
        self._adopt_checkpoint_manager()
        return self.actor_model.finish_checkpoint(wait)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, local_path: str, del_local_after_load: bool = False) -> None:
        self._need("actor", "load_checkpoint")
        self._adopt_checkpoint_manager()
        self.actor_model.load_checkpoint(local_path)


class CriticWorker(Worker, DistProfilerExtension):
    """The value model (an LM body with a one-output token head), trained with the clipped value loss.

    A backend's subclass sets `strategy` and implements `_engine_config` and `_make_critic`, as in
    `ActorRolloutRefWorker`."""

    strategy: str = ""

    def __init__(self, config: DictConfig):
        super().__init__()
        self.config = config
        os.environ["VERL_ROLE"] = "critic"
        self.ulysses = UlyssesRows(*role_sp(config, "critic"))
        with open_dict(self.config):  # the raw section's token budgets, before it is built
            scale_token_budgets(self.config, _CRITIC_TOKEN_BUDGETS, self.ulysses.sp)
        cfg = omega_conf_to_dataclass(config, CriticConfig)
        # only a Megatron critic has its own nccl_timeout (upstream's); an FSDP one takes the default
        _join_group(self, cfg.nccl_timeout if "nccl_timeout" in cfg else None)
        self.init_profiler(self.rank, cfg.profiler, "critic")
        self.critic_config = cfg  # the engine section `_data_parallel_size` reads
        self.dp_size = dp = self._data_parallel_size() // self.ulysses.sp
        self.critic_config = dataclasses.replace(cfg, ppo_mini_batch_size=cfg.ppo_mini_batch_size * cfg.rollout_n // dp)

    def _engine_config(self):
        """The critic's engine section in this backend's place for it."""
        raise NotImplementedError(f"{type(self).__name__} names no critic engine section")

    def _make_critic(self, engine: BaseEngine):
        """The critic logic (values, value update) around `engine`."""
        raise NotImplementedError(f"{type(self).__name__} builds no critic")

    def _register_outputs(self) -> None:
        """As `ActorRolloutRefWorker._register_outputs`."""

    def _engine_options(self) -> dict:
        """Keyword arguments of this backend's value engine beyond the shared ones."""
        return {}

    def _data_parallel_size(self) -> int:
        engine_cls = EngineRegistry.get_engine_cls("value_model", self.strategy)
        dp_size = engine_cls.init_parallel(self._engine_config())
        self.is_collect = engine_cls.is_mp_src_rank_with_outputs()
        self._register_outputs()
        return dp_size

    def _build_critic(self):
        """(engine, critic) of the value model."""
        cfg = self.critic_config
        engine = EngineRegistry.new(
            "value_model",
            self.strategy,
            cfg.model,
            self._engine_config(),
            cfg.optim,
            cfg.checkpoint,
            self.tokenizer,
            **self._engine_options(),
        )
        return engine, self._make_critic(engine)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        from verl.utils.import_utils import import_external_libs
        from verl.utils.tokenizer import hf_tokenizer

        model = self.critic_config.model
        import_external_libs(model.external_lib)  # as the actor's (ActorRolloutRefWorker.init_model)
        self.tokenizer = hf_tokenizer(model.tokenizer_path or model.path)
        if model.get("custom_chat_template"):  # upstream's model section sets it on the tokenizer
            self.tokenizer.chat_template = model.custom_chat_template
        self.critic_model, self.critic = self._build_critic()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def speed_paths(self) -> list[dict]:
        """This rank's speed paths (`verl.utils.speed_paths`) as dicts: the critic's remove padding and fused kernels."""
        # a value model has no fused-kernel keys (upstream's critic model has none either)
        return [
            path.to_dict()
            for path in model_speed_paths(self.critic, self.critic_config.model.use_remove_padding, False)
        ]

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    @DistProfiler.annotate("compute_values")
    def compute_values(self, data: DataProto) -> DataProto:
        data = self.ulysses.gather(data)
        cfg = self.critic_config
        # only an FSDP critic has its own forward micro-batch (upstream's); the training one otherwise
        forward_micro = cfg.forward_micro_batch_size_per_gpu if "forward_micro_batch_size_per_gpu" in cfg else None
        data.meta_info.setdefault("micro_batch_size", forward_micro or cfg.ppo_micro_batch_size_per_gpu or len(data))
        data.meta_info.setdefault("use_dynamic_bsz", cfg.use_dynamic_bsz)
        data.meta_info.setdefault("max_token_len", cfg.forward_max_token_len_per_gpu)
        with self.critic_model.on_device():
            values = self.critic.compute_values(data)
        return self.ulysses.own(DataProto.from_dict(tensors={"values": values}))

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    @DistProfiler.annotate("update_critic")
    def update_critic(self, data: DataProto) -> DataProto:
        data = self.ulysses.gather(data)
        with self.critic_model.on_device(optimizer=True), _device_timer() as compute_s:
            metrics = self.critic.update_critic(data)
        metrics["critic/lr"] = self.critic_model.lr_scheduler_step()
        critic_mfu = _mfu_metric(self.critic.flops.total(), compute_s[0], self.dp_size)
        if critic_mfu is not None:
            metrics["perf/mfu/critic"] = critic_mfu
        return DataProto(meta_info={"metrics": metrics})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, local_path: str, global_step: int = 0, max_ckpt_to_keep: int | None = None) -> None:
        self.critic_model.save_checkpoint(local_path, global_step, max_ckpt_to_keep)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def finish_checkpoint(self, wait: bool = True) -> bool:
        """Whether this rank's background checkpoint write (`checkpoint.async_save`) is done."""
        return self.critic_model.finish_checkpoint(wait)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, local_path: str, del_local_after_load: bool = False) -> None:
        self.critic_model.load_checkpoint(local_path)


def trace_run_names(config, project_name: str | None, experiment_name: str | None) -> dict:
    """The names the agent loops' traces are filed under: `rollout.trace.project_name` / `experiment_name`
    (upstream v0.9's keys, which follow the trainer's by default) when set, else the trainer's names."""
    rollout = config.get("rollout") if hasattr(config, "get") else None
    trace = (rollout.get("trace") if rollout is not None else None) or {}
    return {
        "project_name": trace.get("project_name") or project_name,
        "experiment_name": trace.get("experiment_name") or experiment_name,
    }
