"""The training-engine interface the role workers are written on, and the registry of its backends.

An engine owns one model on this rank and everything that depends on how it is parallelised: the
build from an HF checkpoint (sharded with FSDP2, or cut into megatron tensor/pipeline chunks), the
optimizer and lr schedule, host offload between uses, checkpoints, and the export of full HF-named
weights for the rollout engine. The role logic (what an actor or critic computes from the model)
is not here: it lives in the actor/critic classes, which the workers build around an engine.

Backends are siblings: `FSDPEngine` and `MegatronEngine` both implement `BaseEngine`, neither
subclasses the other, and helpers they share live in `verl.workers.engine.utils`. A worker asks the
registry for `(model_type, backend)` (`"language_model"` / `"value_model"`, and the role's
`strategy`), as upstream verl's `EngineRegistry` does.

The role workers' micro-batch loops and their loss weighting are the actor's and critic's
(`verl.workers.actor.ppo_actor`, `verl.workers.critic.ppo_critic`), written once; each backend's
actor supplies only the forward pass and the gradient step. Upstream's batch-level interface
(`train_batch` / `infer_batch` / `forward_backward_batch` with a caller's loss function, what
`verl.workers.engine_workers.TrainingWorker` runs) is `verl.workers.engine.batch_api.EngineBatchAPI`,
which every engine inherits; a backend adds its packed forward to it.
"""

from __future__ import annotations

import abc
import contextlib

import torch

from verl.workers.engine.batch_api import EngineBatchAPI

__all__ = ["BaseEngine", "EngineRegistry"]


class BaseEngine(EngineBatchAPI, abc.ABC):
    """One model on this rank, with (when trained) its optimizer, lr schedule and checkpoints.

    Built as `Engine(model_config, engine_config, optimizer_config=None, checkpoint_config=None,
    tokenizer=None)`: `model_config` is the role's `model` section, `engine_config` its backend
    section (`fsdp_config` or `megatron`); without `optimizer_config` the model is frozen (a
    reference policy, a reward model) and the training methods are unavailable.
    """

    hf_config = None
    """The HF config the model was built from."""

    optimizer: torch.optim.Optimizer | None = None

    lora = False
    """Whether the trained model carries LoRA adapters: its base (`disable_adapter`) is then the
    initial policy, which the reference can use instead of a second copy of the weights."""

    # ------------------------------------------------------------ layout
    @classmethod
    @abc.abstractmethod
    def init_parallel(cls, engine_config) -> int:
        """Set up this backend's process groups for a role with `engine_config`; returns the number
        of data-parallel replicas (ranks holding different data). Called once per role, before the build."""

    @staticmethod
    def data_parallel_rank() -> int:
        """This rank's data-parallel index once `init_parallel` ran (every rank its own, without model parallelism)."""
        import torch.distributed as dist

        return dist.get_rank() if dist.is_initialized() else 0

    @staticmethod
    def is_mp_src_rank_with_outputs() -> bool:
        """Whether this rank returns its replica's results (the others of a model-parallel group
        compute the same, or only part of it). Every rank, without model parallelism."""
        return True

    # ------------------------------------------------------------ modes and offload
    # `train_mode()` / `eval_mode()` (EngineBatchAPI) switch the mode and return a context manager
    @abc.abstractmethod
    def _switch_mode(self, training: bool) -> None:
        """Put the model in training (dropout etc. on) or evaluation mode."""

    @abc.abstractmethod
    def on_device(self, optimizer: bool = False) -> contextlib.AbstractContextManager:
        """The parameters (and, with `optimizer`, the optimizer state) on the device for the block;
        back on the host afterwards when offloaded (`param_offload` / `optimizer_offload`)."""

    def disable_adapter(self) -> contextlib.AbstractContextManager:
        """Context in which the model computes as its base model (LoRA off); a no-op without LoRA."""
        return contextlib.nullcontext()

    # ------------------------------------------------------------ training state
    # Written once for every backend: a trained engine sets `optimizer`, `lr_scheduler` and its
    # backend's `checkpoint_manager` when it builds; a frozen one leaves `optimizer` None.
    lr_scheduler = None
    checkpoint_manager = None

    def _require_optimizer(self, method: str) -> None:
        if self.optimizer is None:
            raise RuntimeError(f"{method}: this engine was built without an optimizer_config (a frozen model)")

    def lr_scheduler_step(self) -> float:
        """Advance the lr schedule by one step; returns the lr the step just taken used."""
        self._require_optimizer("lr_scheduler_step")
        lr = self.lr_scheduler.get_last_lr()[0]
        self.lr_scheduler.step()
        return lr

    def save_checkpoint(self, local_path: str, global_step: int = 0, max_ckpt_to_keep: int | None = None) -> None:
        """Weights, optimizer, scheduler and RNG state (as `checkpoint.save_contents` asks) under `local_path`."""
        self._require_optimizer("save_checkpoint")
        with self.on_device(optimizer=True):  # the checkpoint manager reads the state on the device
            self.checkpoint_manager.save_checkpoint(
                local_path, global_step=global_step, max_ckpt_to_keep=max_ckpt_to_keep
            )

    def finish_checkpoint(self, wait: bool = True) -> bool:
        """Whether no checkpoint is still being written in the background (`checkpoint.async_save`),
        waiting for it with `wait`; raises if that write failed. True for an engine without a checkpoint manager."""
        if self.checkpoint_manager is None:
            return True
        return self.checkpoint_manager.finish_pending_save(wait)

    def load_checkpoint(self, local_path: str) -> None:
        """Restore what `save_checkpoint` wrote."""
        self._require_optimizer("load_checkpoint")
        with self.on_device(optimizer=True):
            self.checkpoint_manager.load_checkpoint(local_path)

    # ------------------------------------------------------------ weights for the rollout
    @abc.abstractmethod
    def iter_hf_params(self, dtype: torch.dtype | None = None):
        """`(hf_name, full_tensor)` pairs, streamed one at a time; a collective over the ranks that
        hold parts of a tensor, so every such rank must iterate to the end. `dtype` casts the
        floating-point tensors (before the gather where the backend can)."""

    def get_per_tensor_param(self, layered_summon: bool = False, base_sync_done: bool = False, dtype=None, **kwargs):
        """Upstream's form of `iter_hf_params`: `(generator of (hf_name, full_tensor), peft_config)`.

        The peft config is always None here: with LoRA the generator yields the merged weights
        `W + scaling * B @ A` under the base model's names, so a rollout needs no adapter to load
        (upstream sends the adapter apart once the base weights are synced, `base_sync_done`; the
        merged weights give the engine the same model). `layered_summon` (upstream's layer-by-layer
        gather of LoRA weights) changes nothing here: the tensors are already gathered one at a time.
        `kwargs` takes upstream's other backends' keywords, none of which changes what is sent."""
        return self.iter_hf_params(dtype), None


# upstream's backends whose config classes exist here (verl.workers.config) but whose engines do not
_ENGINES_NOT_IN_THIS_BUILD = {"veomni": "VeOmni"}


class EngineRegistry:
    """`(model_type, backend)` -> engine class. Backends register with `@EngineRegistry.register`."""

    _engines: dict[tuple[str, str], type[BaseEngine]] = {}

    @classmethod
    def register(cls, model_type: str, backend: str | list[str]):
        """Class decorator: the engine for `model_type` on `backend` (a name or several aliases)."""
        backends = [backend] if isinstance(backend, str) else list(backend)

        def decorator(engine_cls: type[BaseEngine]) -> type[BaseEngine]:
            for name in backends:
                key = (model_type, name)
                if key in cls._engines and cls._engines[key] is not engine_cls:
                    raise ValueError(
                        f"an engine for model_type={model_type!r}, backend={name!r} is already registered "
                        f"({cls._engines[key].__name__}); register {engine_cls.__name__} under another name"
                    )
                cls._engines[key] = engine_cls
            return engine_cls

        return decorator

    @classmethod
    def get_engine_cls(cls, model_type: str, backend: str) -> type[BaseEngine]:
        engine_cls = cls._engines.get((model_type, backend))
        if engine_cls is None and backend in _ENGINES_NOT_IN_THIS_BUILD:
            raise ValueError(
                f"strategy {backend!r} selects upstream's {_ENGINES_NOT_IN_THIS_BUILD[backend]} engine, which is not in "
                "this build (its config classes are, for code that builds them); use strategy fsdp or megatron"
            )
        if engine_cls is None:
            valid = sorted(f"{m}/{b}" for m, b in cls._engines)
            raise ValueError(
                f"no training engine for model_type={model_type!r} on backend (strategy) {backend!r}; "
                f"registered model_type/backend pairs: {valid}"
            )
        return engine_cls

    @classmethod
    def new(cls, model_type: str, backend: str, *args, **kwargs) -> BaseEngine:
        """Build the engine registered for `(model_type, backend)` with the given arguments."""
        return cls.get_engine_cls(model_type, backend)(*args, **kwargs)
