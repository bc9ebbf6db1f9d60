"""`TrainingWorker`: one training engine behind a worker group, driven batch by batch with the
caller's loss function (upstream's "Tinker-like" API, `verl.workers.engine_workers.TrainingWorker`).

    config = TrainingWorkerConfig(model_type="language_model", model_config=HFModelConfig(path=...),
                                  engine_config=FSDPEngineConfig(...), optimizer_config=FSDPOptimizerConfig(...))
    wg = RayWorkerGroup(resource_pool, RayClassWithInitArgs(ray.remote(TrainingWorker), config=config))
    wg.reset()                                               # build the model (again: from the checkpoint)
    wg.set_loss_fn(functools.partial(sft_loss, config=config))
    metrics = tu.get(wg.train_batch(batch).get(), "metrics")  # batch: a packed TensorDict (see below)

The batch is a TensorDict with jagged `input_ids` / `position_ids` and a `loss_mask`
(`verl.workers.utils.padding.left_right_2_no_padding` makes one from an RL batch; see
`verl.workers.engine.batch_api` for the keys). Batch settings the caller leaves out come from the
engine config: `use_dynamic_bsz`, `max_token_len_per_gpu` / `micro_batch_size_per_gpu` (their
`infer_*` forms for `infer_batch`), `use_fused_kernels`.

Results are TensorDicts: `infer_batch` returns the per-token outputs (`log_probs`, `entropy`,
`values`: jagged, in the input's row order) and `metrics`; the training calls return `metrics`
only. `metrics` holds `loss` (the batch's loss: the micro-batch losses summed on each rank, then
averaged over the data-parallel ranks), `grad_norm`, `lr` (when the schedule stepped), `mfu` (when
the device's peak is known) and each metric of the loss function as one flat list over the
micro-batches of every rank (a `Metric` stays a `Metric`).
"""

from __future__ import annotations

import contextlib
import itertools
import time

import torch
import torch.distributed as dist
from tensordict import NonTensorData, TensorDict

from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, make_nd_compute_dataproto_dispatch_fn, register
from verl.utils import device as dev
from verl.utils import tensordict_utils as tu
from verl.utils.metric import Metric
from verl.utils.profiler import DistProfilerExtension
from verl.workers.config import TrainingWorkerConfig
from verl.workers.group_setup import _join_group

__all__ = ["TrainingWorker"]

_TRAIN_MESH = "train"


def _flatten(values: list):
    """One rank's or all ranks' metric values -> one flat list, or one Metric."""
    if values and isinstance(values[0], Metric):
        return Metric.chain(values)
    flat = []
    for value in values:
        flat.extend(value if isinstance(value, list) else [value])
    return flat


class TrainingWorker(Worker, DistProfilerExtension):
    """One engine (`config.model_type` on `config.engine_config.strategy`) trained or run batch by batch."""

    def __init__(self, config: TrainingWorkerConfig):
        super().__init__()
        if not isinstance(config, TrainingWorkerConfig):
            raise TypeError(f"TrainingWorker takes a TrainingWorkerConfig, got {type(config).__name__}")
        _join_group(self)
        self.config = config
        self.model_config = config.model_config
        self.engine_config = config.engine_config
        self.optimizer_config = config.optimizer_config
        self.checkpoint_config = config.checkpoint_config
        self.device_name = dev.get_device_name()
        if self.engine_config is None:
            if config.auto_select_engine_optim_fn is None:
                raise ValueError(
                    "TrainingWorkerConfig has no engine_config and no auto_select_engine_optim_fn to choose one; "
                    "pass engine_config (FSDPEngineConfig) and optimizer_config"
                )
            self.engine_config, self.optimizer_config = config.auto_select_engine_optim_fn(
                self.model_config, self.device_name
            )
        self.init_profiler(self.rank, config.profiler_config, "train")
        from verl.workers.engine import EngineRegistry

        # the backend's process groups (megatron's tensor/pipeline/context/data groups; every rank a
        # data-parallel rank under FSDP): the ranks of one model replica get the same rows, and one
        # of them (the last pipeline stage's first tensor/context rank) returns the results
        self.engine_cls = EngineRegistry.get_engine_cls(config.model_type, self.engine_config.strategy)
        self.engine_cls.init_parallel(self.engine_config)
        self._register_dispatch_collect_info(
            _TRAIN_MESH,
            dp_rank=self.engine_cls.data_parallel_rank(),
            is_collect=self.engine_cls.is_mp_src_rank_with_outputs(),
        )
        self.engine = None
        self.loss_fn = None

    # ------------------------------------------------------------ setup
    def _require_engine(self, method: str):
        if self.engine is None:
            raise RuntimeError(f"TrainingWorker.{method}: the model is not built yet; call reset() first")
        return self.engine

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def reset(self) -> None:
        """Build the engine from the model path (again, dropping the trained state and optimizer, when
        built before): the model, its sharding, optimizer and lr schedule."""
        self.engine = None
        trains = not self.engine_config.forward_only
        if trains and self.optimizer_config is None:
            raise ValueError(
                "TrainingWorker: engine_config.forward_only is false but there is no optimizer_config; pass one "
                "(e.g. FSDPOptimizerConfig()) or set forward_only=True for an inference-only engine"
            )
        engine_cls = self.engine_cls
        if not engine_cls.has_batch_forward():
            raise NotImplementedError(
                f"TrainingWorker on the {self.engine_config.strategy!r} backend: its engine "
                f"({engine_cls.__name__}) has no batch forward here; use strategy=fsdp (or fsdp2) or megatron"
            )
        self.engine = engine_cls(
            self.model_config,
            self.engine_config,
            optimizer_config=self.optimizer_config if trains else None,
            checkpoint_config=self.checkpoint_config,
        )
        self.flops_counter = None
        if self.engine.hf_config is not None:
            from verl.utils.flops_counter import FlopsCounter

            self.flops_counter = FlopsCounter.for_model(self.engine.hf_config)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def set_loss_fn(self, loss_fn) -> None:
        """`loss_fn(model_output, data, dp_group) -> (loss, metrics)`, e.g. a `functools.partial` of
        `verl.workers.utils.losses.sft_loss` / `ppo_loss` / `value_loss` with its config."""
        self.loss_fn = loss_fn

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True) -> None:
        """Move the model and optimizer state to "device" (this machine's accelerator) or "cpu" by hand;
        pass `disable_auto_offload=True` in a batch to keep them where they are."""
        if device not in ("cpu", "device"):
            raise ValueError(f"TrainingWorker.to({device!r}): use 'device' or 'cpu'")
        self._require_engine("to").to(device=device, model=model, optimizer=optimizer, grad=grad)

    # ------------------------------------------------------------ batches
    def _fill_defaults(self, data: TensorDict, infer: bool) -> None:
        cfg = self.engine_config
        max_tokens = cfg.max_token_len_per_gpu
        micro = cfg.micro_batch_size_per_gpu
        if infer:
            max_tokens = cfg.infer_max_token_len_per_gpu or max_tokens
            micro = cfg.infer_micro_batch_size_per_gpu or micro
        defaults = {
            "use_remove_padding": getattr(self.model_config, "use_remove_padding", True),
            "use_dynamic_bsz": cfg.use_dynamic_bsz,
            "max_token_len_per_gpu": max_tokens,
            "micro_batch_size_per_gpu": micro,
            "use_fused_kernels": cfg.use_fused_kernels,
        }
        present = data.keys()
        tu.assign_non_tensor(data, **{k: v for k, v in defaults.items() if k not in present})

    def _postprocess(self, output: dict, seconds: float, global_token_num, forward_only: bool) -> TensorDict:
        from verl.utils.torch_functional import allgather_dict_into_dict

        group = self.engine.get_data_parallel_group()
        dp_size = self.engine.get_data_parallel_size()  # 1 without a process group
        metrics = dict(output["metrics"])
        loss = torch.tensor(float(sum(output["loss"])), dtype=torch.float64, device=dev.collective_device(group))
        grad_norm = metrics.pop("grad_norm", None)
        lr = metrics.pop("lr", None)
        if dp_size > 1:
            dist.all_reduce(loss, group=group)
            loss /= dp_size
            per_rank = allgather_dict_into_dict(metrics, group=group)
        else:
            per_rank = {key: [value] for key, value in metrics.items()}
        final = {key: _flatten(values) for key, values in per_rank.items()}
        final["loss"] = float(loss)
        if grad_norm is not None:
            final["grad_norm"] = grad_norm
        if lr is not None:
            final["lr"] = lr
        mfu = self._mfu(global_token_num, seconds, forward_only)
        if mfu is not None:
            final["mfu"] = mfu
        model_output = output["model_output"] if forward_only else {}
        return tu.get_tensordict(
            tensor_dict={key: value.cpu() for key, value in model_output.items()}, non_tensor_dict={"metrics": final}
        )

    def _mfu(self, global_token_num, seconds: float, forward_only: bool) -> float | None:
        """Model FLOPs utilisation of a step over `global_token_num` (every rank's sequence lengths) that took
        `seconds`: the FLOPs the step needed over what every rank's device could do in that time; None when
        the device's peak is unknown (`VERL_PEAK_FLOPS` sets it)."""
        if global_token_num is None or self.flops_counter is None or seconds <= 0:
            return None
        achieved, peak = self.flops_counter.estimate_flops(list(global_token_num), seconds)  # TFLOP/s
        if peak == float("inf"):
            return None
        world = dist.get_world_size() if dist.is_initialized() else 1
        # estimate_flops counts forward + backward (3 passes); a forward-only pass did a third of it
        return achieved / peak / world / (3.0 if forward_only else 1.0)

    def _train_batch(self, data: TensorDict) -> TensorDict | None:
        engine = self._require_engine("train_batch")
        if self.loss_fn is None:
            raise RuntimeError("TrainingWorker.train_batch: no loss function; call set_loss_fn(...) first")
        if self.engine_config.forward_only:
            raise RuntimeError("TrainingWorker.train_batch: the engine config is forward_only (inference only)")
        self._fill_defaults(data, infer=False)
        global_token_num = tu.get(data, "global_token_num", None)
        disable_auto_offload = bool(tu.get(data, "disable_auto_offload", False))
        start = time.perf_counter()
        with engine.train_mode(disable_auto_offload=disable_auto_offload):
            output = engine.train_batch(data, loss_function=self.loss_fn)
        seconds = time.perf_counter() - start
        if tu.get(data, "update_lr_scheduler", False):
            output["metrics"]["lr"] = engine.lr_scheduler_step()
        if not engine.is_mp_src_rank_with_outputs():
            return None
        return self._postprocess(output, seconds, global_token_num, forward_only=False)

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name=_TRAIN_MESH), blocking=False)
    def train_batch(self, data: TensorDict) -> TensorDict | None:
        """One optimizer step on `data` (all of it, in micro-batches); `update_lr_scheduler=True` in the
        batch also steps the lr schedule."""
        return self._train_batch(data)

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name=_TRAIN_MESH), blocking=False)
    def train_mini_batch(self, data: TensorDict) -> TensorDict | None:
        """`epochs` passes over `data` in mini-batches (`mini_batch_size` rows over all ranks, or
        `num_mini_batch` per pass), one optimizer step each, shuffled with `seed` when
        `dataloader_kwargs={"shuffle": True}`; the lr schedule steps once, after the last."""
        engine = self._require_engine("train_mini_batch")
        tu.maybe_fix_3d_position_ids(data)
        rows = data.shape[0]
        mini_batch_size = tu.pop(data, "mini_batch_size", None)
        num_mini_batch = tu.pop(data, "num_mini_batch", None)
        epochs = int(tu.pop(data, "epochs", 1))
        seed = int(tu.pop(data, "seed", 42))
        dataloader_kwargs = tu.pop(data, "dataloader_kwargs", None) or {}
        disable_auto_offload = bool(tu.pop(data, "disable_auto_offload", False))
        dp_size = engine.get_data_parallel_size()
        if mini_batch_size is not None:
            if mini_batch_size % dp_size:
                raise ValueError(f"mini_batch_size={mini_batch_size} does not split over {dp_size} data-parallel ranks")
            per_rank = mini_batch_size // dp_size
        elif num_mini_batch is not None:
            if rows % num_mini_batch:
                raise ValueError(f"num_mini_batch={num_mini_batch} does not divide this rank's {rows} rows")
            per_rank = rows // num_mini_batch
        else:
            raise ValueError("train_mini_batch: set mini_batch_size or num_mini_batch in the batch")
        steps = rows // per_rank * epochs
        batches = tu.make_iterator(
            data, per_rank, epochs, seed=seed + engine.get_data_parallel_rank(), dataloader_kwargs=dataloader_kwargs
        )
        outputs = []
        with engine.train_mode(disable_auto_offload=disable_auto_offload):
            for step, mini_batch in enumerate(batches):
                lengths = mini_batch["input_ids"].offsets().diff().tolist()
                if dp_size > 1:
                    gathered = [None] * dp_size
                    dist.all_gather_object(gathered, lengths, group=engine.get_data_parallel_group())
                    lengths = list(itertools.chain.from_iterable(gathered))
                tu.assign_non_tensor(
                    mini_batch,
                    global_token_num=NonTensorData(lengths),  # batch-wide: every rank's lengths
                    update_lr_scheduler=step == steps - 1,
                    disable_auto_offload=True,
                )
                outputs.append(self._train_batch(mini_batch))
        if not engine.is_mp_src_rank_with_outputs():
            return None
        metrics: dict = {}
        for output in outputs:
            for key, value in tu.get(output, "metrics").items():
                metrics.setdefault(key, []).append(value)
        metrics = {key: _flatten(values) for key, values in metrics.items()}
        return tu.get_tensordict(tensor_dict={}, non_tensor_dict={"metrics": metrics})

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name=_TRAIN_MESH), blocking=False)
    def infer_batch(self, data: TensorDict) -> TensorDict | None:
        """The model's per-token outputs on `data` (no gradients); with the loss function set and
        `compute_loss` not False, its loss and metrics too. `no_lora_adapter=True`: the base model."""
        engine = self._require_engine("infer_batch")
        self._fill_defaults(data, infer=True)
        global_token_num = tu.get(data, "global_token_num", None)
        compute_loss = tu.get(data, "compute_loss", True)
        disable_auto_offload = bool(tu.get(data, "disable_auto_offload", False))
        no_adapter = bool(tu.pop(data, "no_lora_adapter", False))
        start = time.perf_counter()
        adapter = engine.disable_adapter() if no_adapter else contextlib.nullcontext()
        with engine.eval_mode(disable_auto_offload=disable_auto_offload), adapter:
            output = engine.infer_batch(data, loss_function=self.loss_fn if compute_loss else None)
        seconds = time.perf_counter() - start
        if not engine.is_mp_src_rank_with_outputs():
            return None
        return self._postprocess(output, seconds, global_token_num, forward_only=True)

    # ------------------------------------------------------------ checkpoints
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None) -> None:
        """The engine's checkpoint under `local_path` (the checkpoint config's `save_contents`); with
        `hdfs_path` rank 0 then copies the directory there (`verl.utils.hdfs_io.copy`)."""
        engine = self._require_engine("save_checkpoint")
        engine.save_checkpoint(local_path, global_step=global_step, max_ckpt_to_keep=max_ckpt_to_keep)
        engine.finish_checkpoint(wait=True)
        if hdfs_path is not None:
            from verl.utils import hdfs_io
            from verl.utils.fs import is_non_local

            if dist.is_initialized():
                dist.barrier()
            if self.rank == 0:
                local_dst = not is_non_local(hdfs_path)
                hdfs_io.copy(src=local_path, dst=hdfs_path, **({"dirs_exist_ok": True} if local_dst else {}))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=False) -> None:
        """Restore what `save_checkpoint` wrote under `local_path` (call `reset()` first)."""
        import shutil

        if hdfs_path is not None:
            raise ValueError(
                "TrainingWorker.load_checkpoint reads local_path only; copy the checkpoint from hdfs_path there first"
            )
        self._require_engine("load_checkpoint").load_checkpoint(local_path)
        if del_local_after_load:
            if dist.is_initialized():
                dist.barrier()
            if self.rank == 0:
                shutil.rmtree(local_path, ignore_errors=True)
