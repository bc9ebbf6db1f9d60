"""Save and restore a megatron-core model, its AdamW state and lr scheduler, reshardably and crash-safely.

Layout of one checkpoint directory (`local_path`, e.g. `.../global_step_10/actor`):

    dist_ckpt/                              megatron dist_checkpointing: the weights and the Adam
                                            moments, each tensor with its global shape
    extra_state_world_size_<W>_rank_<r>.pt  lr scheduler, RNG states, optimizer step and hyper-parameters
    huggingface/                            config.json, tokenizer files, and model.safetensors
                                            (full HF weights) when save_contents has hf_model
    lora_config.json                        with LoRA: model.lora (rank, alpha, targets, ...); the
                                            adapters themselves are in dist_ckpt/ beside the frozen
                                            base (and a critic's trained value head), and hf_model
                                            holds the merged weights

Design decisions:
- The optimizer is a plain torch AdamW over this rank's parameter shards (see
  `verl.workers.actor.megatron_actor`), so megatron's own optimizer checkpointing does not apply.
  Adam's moments have exactly their parameter's shape and sharding, so each moment is saved as a
  copy of its parameter's `ShardedTensor` (same global offsets and replica id) under the key
  `optimizer.<moment>.<parameter key>`. dist_checkpointing then reshards moments exactly like
  weights: a checkpoint written at tp=2 resumes at tp=1 or pp=2 with the same weights *and* the
  same Adam state, and the next update equals the one an uninterrupted run would make.
- With the Adam state split over data-parallel ranks (`use_distributed_optimizer`, torch's
  ZeroRedundancyOptimizer), each rank holds the moments of the parameters it owns: the owner gets
  the writing replica id, so the files are the same as without it and load either way.
- Adam's step count is the same for every parameter that was ever stepped (the actor steps all of
  them together), so one number is kept in the extra state instead of a per-parameter table whose
  order would depend on the layout.
- Crash safety as in `FSDPCheckpointManager`: everything goes into `<local_path>.tmp`, renamed by
  rank 0 after a barrier, with the previous checkpoint kept as `.old` until the swap is done.
- Virtual pipeline: a rank holds several model chunks. Each chunk's sharded entries already carry
  global keys (a layer's global index is its offset along the layer axis), so the files do not
  depend on the chunk count; only the local state-dict names repeat across chunks, so the chunks
  are nested as `model0`, `model1`, ... (and moment names prefixed the same way) on this rank. A
  checkpoint written at pp=2 with 2 virtual stages loads at pp=1 without them, and back.
- On CPU dist_checkpointing needs `verl.utils.megatron.cpu_compat` (switched on with the parallel
  groups) and psutil, without which a save hangs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import torch
import torch.distributed as dist

from verl.utils.checkpoint.checkpoint_manager import BaseCheckpointManager
from verl.utils.checkpoint.safe_load import torch_load
from verl.utils.device import collective_device
from verl.utils.logging_utils import get_logger

__all__ = ["MegatronCheckpointManager", "load_dist_checkpoint_weights"]

logger = get_logger(__name__)

_MOMENTS = ("exp_avg", "exp_avg_sq")
DIST_CKPT_DIR = "dist_ckpt"
LORA_CONFIG_FILE = "lora_config.json"


def _require_psutil() -> None:
    from importlib.util import find_spec

    if find_spec("psutil") is None:
        raise ImportError("megatron's dist_checkpointing needs psutil (without it a save hangs); pip install psutil")


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _sharded_entries(sharded: dict):
    """Every ShardedTensor or ShardedTensorFactory (megatron describes the fused [gate; up] weight
    with a factory) of a nested sharded state dict: both carry `key` and the local `data`."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    for name, value in sharded.items():
        if isinstance(value, ShardedTensor | ShardedTensorFactory):
            yield name, value
        elif isinstance(value, dict):
            yield from _sharded_entries(value)


def _param_keys(model, optimizer) -> list[tuple[torch.nn.Parameter, str, object]]:
    """(trained parameter, its local state-dict name, its sharded entry), matched by storage. The
    entry's own key is global (all layers of a stage share one key, the layer being an axis of the
    global tensor), so the local name is what tells the layers apart on this rank."""
    by_ptr = {p.data_ptr(): p for group in optimizer.param_groups for p in group["params"] if p.requires_grad}
    triples, seen = [], set()
    for name, entry in _sharded_entries(model.sharded_state_dict()):
        param = by_ptr.get(entry.data.data_ptr())
        if param is not None and entry.data.shape == param.shape and id(param) not in seen:
            seen.add(id(param))
            triples.append((param, name, entry))
    return triples


def _chunk_prefixes(chunks) -> list[str]:
    """The local namespace of each model chunk: none for a single chunk (the layout of a checkpoint
    without virtual pipeline), `model<i>.` for interleaved chunks, whose local names repeat."""
    return [""] if len(chunks) == 1 else [f"model{i}." for i in range(len(chunks))]


def _model_sharded_state(chunks) -> dict:
    if len(chunks) == 1:
        return chunks[0].sharded_state_dict()
    return {prefix[:-1]: chunk.sharded_state_dict() for prefix, chunk in zip(_chunk_prefixes(chunks), chunks)}


def load_dist_checkpoint_weights(chunks, path: str, value_head: bool = False, prefix: str = "") -> None:
    """Load the model weights of `chunks` from a megatron dist checkpoint (`megatron.use_dist_checkpointing`).

    `path` is a dist checkpoint directory (the converter's output, `python -m
    verl.models.mcore.converter`, or upstream's converter_hf_to_mcore.py), or a verl megatron
    checkpoint (`.../global_step_N/actor`, whose `dist_ckpt/` is used). The checkpoint may have
    been written at any tensor/pipeline/virtual-pipeline layout: entries are matched by their global
    keys (with `prefix` in front of each, megatron's `sharded_state_dict(prefix=...)`). Entries the
    model does not have (Adam moments, other models) are ignored; a model entry missing from the
    checkpoint is an error. A value head (critic) is never read from it: an LM checkpoint's output
    layer is the vocabulary projection, and the head keeps its initialisation.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import StrictHandling
    from torch.distributed.checkpoint.api import CheckpointException

    _require_psutil()
    path = os.path.abspath(os.path.expanduser(path))
    if os.path.isdir(os.path.join(path, DIST_CKPT_DIR)):
        path = os.path.join(path, DIST_CKPT_DIR)
    if not os.path.isfile(os.path.join(path, "metadata.json")):
        raise FileNotFoundError(
            f"megatron.dist_checkpointing_path={path} is not a megatron dist checkpoint (no metadata.json); "
            "convert the HF model with `python -m verl.models.mcore.converter --hf_model_path HF --output_path OUT`, "
            "or set megatron.use_dist_checkpointing=false to read the HF weights from model.path"
        )
    prefixes = _chunk_prefixes(chunks)
    request = {}
    for local, chunk in zip(prefixes, chunks):
        state = chunk.sharded_state_dict(prefix=prefix)
        if value_head:
            state = {k: v for k, v in state.items() if not k.startswith(prefix + "output_layer.")}
        request[local[:-1] if local else ""] = state
    sharded = request[""] if len(chunks) == 1 else request
    try:
        loaded = dist_checkpointing.load(sharded, path, strict=StrictHandling.ASSUME_OK_UNEXPECTED)
    except (Exception, CheckpointException) as e:  # torch's CheckpointException is a BaseException
        raise RuntimeError(
            f"megatron dist checkpoint {path} does not hold this model's weights ({type(e).__name__}: {e}); "
            "was it converted from another model, or written with another megatron.dist_checkpointing_prefix?"
        ) from e
    states = [loaded] if len(chunks) == 1 else [loaded[p[:-1]] for p in prefixes]
    for chunk, state in zip(chunks, states):
        state = {k[len(prefix) :] if k.startswith(prefix) else k: v for k, v in state.items()}
        result = chunk.load_state_dict(state, strict=False)
        ignored = ("output_layer.",) if value_head else ()
        missing = [k for k in result.missing_keys if not k.endswith("_extra_state") and not k.startswith(ignored)]
        if missing:
            raise RuntimeError(f"megatron dist checkpoint {path} lacks {missing}")


def _chunk_param_keys(chunks, optimizer) -> list[tuple[torch.nn.Parameter, str, object]]:
    """`_param_keys` of every chunk, local names prefixed with their chunk's namespace."""
    return [
        (param, prefix + name, entry)
        for prefix, chunk in zip(_chunk_prefixes(chunks), chunks)
        for param, name, entry in _param_keys(chunk, optimizer)
    ]


def _owner_replica_id(replica_id, owned: bool, expert: bool = False):
    """The replica id that makes the data-parallel rank owning a parameter's Adam state the one that
    writes it (megatron's last replica coordinate is the rank in the data x context-parallel group;
    all zeros writes). Context-parallel ranks of the owner hold the same state: only the first writes.
    Under expert parallelism the state is split over smaller replica groups (context ranks included,
    see `verl.utils.megatron.parallel_state.parameter_replica_group`), one of which writes each
    parameter; the others take their global rank, unique among all holders of a shard.

    Without expert parallelism but with experts split over fewer ranks than the dense layers
    (expert_tensor_parallel_size < tensor_model_parallel_size), several tensor ranks hold the same
    expert shard and, their data-parallel groups splitting identical parameter lists, the same
    share of its moments: only the first of them writes (issue #27: all of them did, and megatron
    refused the checkpoint with "Invalid access pattern"). Split over more ranks
    (expert_tensor_parallel_size > tensor_model_parallel_size), the state is split over the replica
    groups as under expert parallelism, and one group writes the dense moments."""
    from megatron.core import parallel_state as mpu

    from verl.utils.megatron.parallel_state import writes_optimizer_state

    if mpu.get_expert_model_parallel_world_size() > 1:
        writes, other = writes_optimizer_state(owned, expert), dist.get_rank() + 1
    elif mpu.get_expert_tensor_parallel_world_size() != mpu.get_tensor_model_parallel_world_size():
        writes = writes_optimizer_state(owned, expert) and mpu.get_context_parallel_rank() == 0
        other = dist.get_rank() + 1
    else:
        writes = owned and mpu.get_context_parallel_rank() == 0
        other = mpu.get_data_parallel_rank(with_context_parallel=True) + 1
    if isinstance(replica_id, tuple):
        return (*replica_id[:-1], 0 if writes else other)
    return 0 if writes else other


def _moment_sharded_state(chunks, optimizer) -> dict:
    """The Adam moments as sharded entries shaped and sharded like their parameters (zeros for a
    parameter not stepped yet, or whose state another data-parallel rank owns, without touching the
    optimizer's state). With the state sharded over data-parallel ranks, each moment is written by
    its owner."""
    from verl.utils.optim import local_optimizer

    local = local_optimizer(optimizer)
    # with sharded state, the local optimizer holds exactly the parameters this rank owns
    owned = {id(p) for group in local.param_groups for p in group["params"]} if local is not optimizer else None
    out = {}
    for param, name, entry in _chunk_param_keys(chunks, optimizer):
        state = local.state.get(param, {})
        extra = {}
        if owned is not None:
            extra["replica_id"] = _owner_replica_id(entry.replica_id, id(param) in owned, ".mlp.experts." in name)
        for moment in _MOMENTS:
            data = state[moment] if moment in state else torch.zeros_like(param)
            out[f"optimizer.{moment}.{name}"] = dataclasses.replace(
                entry, key=f"optimizer.{moment}.{entry.key}", data=data, **extra
            )
    return out


class MegatronCheckpointManager(BaseCheckpointManager):
    """Checkpoints of a megatron model with its AdamW optimizer and lr scheduler.

    `model` is the list of this rank's model chunks (several with virtual pipeline); `hf_config` is
    the HF config the model was built from (written to `huggingface/`). `hf_weights`, needed for
    `hf_model` in `save_contents`, streams the model's full HF-named tensors (a collective): the
    engine that built the model hands over its converter (`MegatronEngine.iter_hf_params`),
    so this module, below the models layer, converts nothing itself.
    """

    def __init__(
        self,
        model,
        optimizer=None,
        lr_scheduler=None,
        processing_class=None,
        checkpoint_config=None,
        *,
        hf_config=None,
        hf_weights=None,
        lora_config: dict | None = None,
    ):
        super().__init__(model, optimizer, lr_scheduler, processing_class, checkpoint_config)
        self.chunks = list(model)
        self.hf_config = hf_config
        self.hf_weights = hf_weights
        self.lora_config = lora_config

    @staticmethod
    def _extra_state_name(world_size: int, rank: int) -> str:
        return f"extra_state_world_size_{world_size}_rank_{rank}.pt"

    def _optimizer_step(self) -> int:
        """Adam's step count (the same for every stepped parameter); a collective, since with the
        state sharded over data-parallel ranks a rank may hold no stepped parameter."""
        from verl.utils.optim import local_optimizer

        steps = [int(s["step"]) for s in local_optimizer(self.optimizer).state.values() if "step" in s]
        step = torch.tensor(max(steps, default=0), dtype=torch.int64, device=collective_device())
        dist.all_reduce(step, op=dist.ReduceOp.MAX)
        return int(step)

    def save_checkpoint(self, local_path: str, hdfs_path=None, global_step: int = 0, max_ckpt_to_keep=None):
        from megatron.core import dist_checkpointing

        _require_psutil()
        rank, world = dist.get_rank(), dist.get_world_size()
        local_path = os.path.abspath(local_path)
        tmp = local_path + ".tmp"
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(os.path.join(tmp, DIST_CKPT_DIR))
        _barrier()
        sharded = {}
        if "model" in self.save_contents:
            sharded.update(_model_sharded_state(self.chunks))
        if "optimizer" in self.save_contents and self.optimizer is not None:
            sharded.update(_moment_sharded_state(self.chunks, self.optimizer))
        if sharded:
            dist_checkpointing.save(sharded, os.path.join(tmp, DIST_CKPT_DIR))
        if "extra" in self.save_contents or "optimizer" in self.save_contents:
            extra = {"global_step": global_step, "rng": self.get_rng_state()}
            if self.lr_scheduler is not None:
                extra["lr_scheduler"] = self.lr_scheduler.state_dict()
            if self.optimizer is not None:
                extra["optimizer_step"] = self._optimizer_step()
                extra["param_groups"] = [
                    {k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups
                ]
            torch.save(extra, os.path.join(tmp, self._extra_state_name(world, rank)))
        if self.lora_config is not None and rank == 0:
            # the adapters' layout and scale, which their tensors alone do not tell (the model merger reads it)
            with open(os.path.join(tmp, LORA_CONFIG_FILE), "w") as f:
                json.dump(self.lora_config, f, indent=2)
        hf_dir = os.path.join(tmp, "huggingface")
        self._save_huggingface(hf_dir, rank)
        _barrier()
        if rank == 0:
            old = local_path + ".old"
            if os.path.exists(local_path):
                shutil.rmtree(old, ignore_errors=True)
                os.rename(local_path, old)
            os.rename(tmp, local_path)
            shutil.rmtree(old, ignore_errors=True)
        _barrier()
        if rank == 0:
            self.register_checkpoint(local_path, max_ckpt_to_keep)

    def _save_huggingface(self, hf_dir: str, rank: int) -> None:
        """Config and tokenizer always; the full HF weights (gathered, collective) with hf_model."""
        if rank == 0:
            os.makedirs(hf_dir, exist_ok=True)
            if self.hf_config is not None:
                self.hf_config.save_pretrained(hf_dir)
            if self.processing_class is not None:
                self.processing_class.save_pretrained(hf_dir)
        if "hf_model" not in self.save_contents:
            return
        from safetensors.torch import save_file

        if self.hf_weights is None:
            raise ValueError(
                "checkpoint.save_contents asks for hf_model, but this MegatronCheckpointManager was built without "
                "hf_weights (the model's HF-named tensors); pass the engine's iter_hf_params, or drop hf_model"
            )
        tensors = {name: tensor.detach().cpu().contiguous() for name, tensor in self.hf_weights()}
        if rank == 0:
            save_file(tensors, os.path.join(hf_dir, "model.safetensors"), metadata={"format": "pt"})

    def load_checkpoint(self, local_path: str | None, hdfs_path=None, del_local_after_load=False):
        from megatron.core import dist_checkpointing

        if local_path is None:
            return
        _require_psutil()
        local_path = os.path.abspath(local_path)
        if not os.path.isdir(local_path) and os.path.isdir(local_path + ".old"):
            local_path += ".old"  # a crash between the two renames of a save
        ckpt = os.path.join(local_path, DIST_CKPT_DIR)
        want_model = "model" in self.load_contents
        want_optim = "optimizer" in self.load_contents and self.optimizer is not None
        if (want_model or want_optim) and not os.path.isdir(ckpt):
            raise FileNotFoundError(
                f"no megatron checkpoint at {ckpt}: {local_path} was not written by the megatron backend "
                "(an FSDP checkpoint cannot be resumed with strategy=megatron); resume with the backend that saved it"
            )
        rank, world = dist.get_rank(), dist.get_world_size()
        extra_file = os.path.join(local_path, self._extra_state_name(world, rank))
        if not os.path.exists(extra_file):  # written on another number of ranks: rank 0's file serves all
            names = sorted(n for n in os.listdir(local_path) if n.startswith("extra_state_world_size_"))
            extra_file = os.path.join(local_path, names[0]) if names else None
        extra = torch_load(extra_file, "extra state") if extra_file else {}
        sharded = {}
        if want_model:
            sharded.update(_model_sharded_state(self.chunks))
        if want_optim:
            sharded.update(_moment_sharded_state(self.chunks, self.optimizer))
        if sharded:
            loaded = dist_checkpointing.load(sharded, ckpt)
            if want_model:
                model_state = {k: v for k, v in loaded.items() if not k.startswith("optimizer.")}
                prefixes = _chunk_prefixes(self.chunks)
                states = [model_state[p[:-1]] if p else model_state for p in prefixes]
                for chunk, state in zip(self.chunks, states):
                    result = chunk.load_state_dict(state, strict=False)
                    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
                    if missing or result.unexpected_keys:
                        raise RuntimeError(
                            f"megatron checkpoint {ckpt} does not match the model: missing {missing}, unexpected "
                            f"{result.unexpected_keys}; was it written for another architecture?"
                        )
        if want_optim:
            self._restore_optimizer(loaded, extra)
        if "extra" in self.load_contents and extra:
            if self.lr_scheduler is not None and "lr_scheduler" in extra:
                self.lr_scheduler.load_state_dict(extra["lr_scheduler"])
            if "rng" in extra and extra_file and extra_file.endswith(self._extra_state_name(world, rank)):
                self.load_rng_state(extra["rng"])

    def _restore_optimizer(self, loaded: dict, extra: dict) -> None:
        """Loaded moments are already in the optimizer's tensors (dist_checkpointing loads in place,
        or returns them); set the step count and the saved hyper-parameters through the optimizer's
        own load_state_dict, which puts `step` where this optimizer keeps it."""
        moments = {k: v for k, v in loaded.items() if k.startswith("optimizer.")}
        by_key = {}
        for key, value in moments.items():
            _, moment, param_key = key.split(".", 2)
            by_key.setdefault(param_key, {})[moment] = value
        from verl.utils.optim import local_optimizer

        local = local_optimizer(self.optimizer)  # with sharded state: only this rank's parameters
        state = local.state_dict()
        index = {id(param): name for param, name, _ in _chunk_param_keys(self.chunks, self.optimizer)}
        step = float(extra.get("optimizer_step", 0))
        flat = [p for group in local.param_groups for p in group["params"]]
        for i, param in enumerate(flat):
            key = index.get(id(param))
            if step > 0 and key in by_key:
                state["state"][i] = {"step": torch.tensor(step), **{m: by_key[key][m] for m in _MOMENTS}}
        saved_groups = extra.get("param_groups", [])
        for group, saved in zip(state["param_groups"], saved_groups):
            group.update({k: v for k, v in saved.items() if k in group})
        local.load_state_dict(state)
        if local is not self.optimizer:  # the wrapper's hyper-parameters are copied to the local one at each step
            for group, saved in zip(self.optimizer.param_groups, saved_groups):
                group.update({k: v for k, v in saved.items() if k in group and k != "params"})
