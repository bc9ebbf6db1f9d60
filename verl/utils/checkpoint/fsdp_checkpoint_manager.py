"""Save and restore an FSDP2 model, its optimizer and lr scheduler, crash-safely.

Layout of one checkpoint directory (`local_path`, e.g. `.../global_step_10/actor`):

    model/                                  DCP: one shard file per rank + .metadata
    optim/                                  DCP: the optimizer state, sharded the same way
    extra_state_world_size_<W>_rank_<r>.pt  lr scheduler state, RNG states, global step
    huggingface/                            config.json, generation config, tokenizer files,
                                            and model.safetensors when save_contents has hf_model
    lora_adapter/                           a LoRA model only: the adapter in PEFT's format
                                            (adapter_config.json, adapter_model.safetensors)

Model and optimizer go through `torch.distributed.checkpoint` (DCP) with the state-dict API
(`get_model_state_dict` / `set_model_state_dict`), so each rank writes only its shard, nothing is
gathered, and a checkpoint loads on a different number of ranks (DCP reshards on load). The
per-rank extra state holds what differs per rank (RNG); on a different world size the lr
scheduler is taken from rank 0's file and the RNG is left as is.

Crash safety: everything is written into `<local_path>.tmp` and rank 0 renames it to
`local_path` only after every rank finished (a barrier). A crash mid-save leaves at most a stale
`.tmp` (removed by the next save) and never touches an existing checkpoint. When re-saving over an
existing `local_path` the old one is first renamed to `<local_path>.old` and deleted after the swap;
`load_checkpoint` falls back to `.old` if a crash hit between those two renames. Retention
(`max_ckpt_to_keep`) deletes old checkpoints only after the new one is complete.

A LoRA (peft) model is saved whole in `model/` (base and adapters, under peft's names), so a
resume restores it exactly; `lora_adapter/` is the adapter alone for `PeftModel.from_pretrained`,
and `hf_model` writes the merged weights under plain HF names.

Background writes (`checkpoint.async_save`, see verl.utils.checkpoint.checkpoint_manager): the
model and optimizer state dicts are copied to host memory during `save_checkpoint`; extra state,
`huggingface/` and the adapter (small, or collective) are written at once into the `.tmp` directory;
a writer thread then writes the DCP shards and publishes the directory exactly as above. The files
equal a synchronous save's.

Loading never executes code from the checkpoint: DCP goes through `safe_load.dcp_load` and the
extra state through `torch.load(weights_only=True)` (see verl.utils.checkpoint.safe_load).

All ranks must see the same filesystem at `local_path` (as DCP needs for loading anyway). The
caller must have the model and optimizer on the device (load them back if offloaded).
"""

from __future__ import annotations

import os
import shutil

import torch
import torch.distributed as dist

from verl.utils.checkpoint.checkpoint_manager import BaseCheckpointManager, snapshot_to_host
from verl.utils.checkpoint.safe_load import dcp_load, torch_load
from verl.utils.device import collective_device
from verl.utils.logging_utils import get_logger
from verl.utils.lora import ADAPTER_DIR, is_peft_model, lora_scalings, merge_lora_state, save_lora_adapter

__all__ = ["FSDPCheckpointManager"]

logger = get_logger(__name__)


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier(group=None) -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier(group=group)


def _unwrapped_class(model):
    """The HF class under FSDP2's dynamic `FSDP<Name>` subclass."""
    from torch.distributed.fsdp import FSDPModule

    for cls in type(model).__mro__:
        if not issubclass(cls, FSDPModule):
            return cls
    raise TypeError(f"cannot find the model class of {type(model).__name__}")


class FSDPCheckpointManager(BaseCheckpointManager):
    """Checkpoint manager for FSDP2-sharded HF models (also works unsharded, in one process).

    Args:
        model: the (sharded) HF model.
        optimizer: its optimizer, or None (e.g. the reference policy).
        lr_scheduler: its lr scheduler, or None.
        processing_class: tokenizer or processor saved to `huggingface/` for export.
        checkpoint_config: `save_contents` / `load_contents` lists and `async_save` (see BaseCheckpointManager).
    """

    supports_async_save = True

    def __init__(self, model, optimizer=None, lr_scheduler=None, processing_class=None, checkpoint_config=None):
        super().__init__(model, optimizer, lr_scheduler, processing_class, checkpoint_config)

    @staticmethod
    def _extra_state_name(world_size: int, rank: int) -> str:
        return f"extra_state_world_size_{world_size}_rank_{rank}.pt"

    def save_checkpoint(
        self, local_path: str, hdfs_path: str | None = None, global_step: int = 0, max_ckpt_to_keep: int | None = None
    ) -> None:
        """Write the checkpoint to `local_path` (collective: every rank calls it).

        With `checkpoint.async_save` the model and optimizer state is copied to host memory here and
        written by a background thread; this returns once the copy is taken, and `local_path`
        appears when the write is complete (`finish_pending_save` tells when). Copying checkpoints to
        `trainer.default_hdfs_dir` is the trainer's job (the whole step), so `hdfs_path`, kept for
        upstream's signature, must be None.
        """
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        if hdfs_path is not None:
            raise NotImplementedError(
                "FSDPCheckpointManager.save_checkpoint(hdfs_path=...) is not supported; the PPO trainer copies each "
                "step to trainer.default_hdfs_dir after it is complete"
            )
        self.finish_pending_save()  # one write in flight at a time; an earlier failure is raised here
        rank, world_size = _rank_world()
        final = os.path.abspath(local_path)
        tmp = final + ".tmp"
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a crashed save
            os.makedirs(tmp)
        _barrier()

        model_state = get_model_state_dict(self.model) if "model" in self.save_contents else None
        optim_state = None
        if "optimizer" in self.save_contents and self.optimizer is not None:
            optim_state = get_optimizer_state_dict(self.model, self.optimizer)
        if not self.async_save:
            self._write_shards(tmp, model_state, optim_state, group=None)
            self._save_small_files(tmp, rank, world_size, global_step)
            self._publish(tmp, final, rank, max_ckpt_to_keep, group=None)
            return
        model_state, optim_state = snapshot_to_host(model_state), snapshot_to_host(optim_state)
        self._save_small_files(tmp, rank, world_size, global_step)
        group = self._writer_group()

        def write():
            self._write_shards(tmp, model_state, optim_state, group)
            self._publish(tmp, final, rank, max_ckpt_to_keep, group)

        self._start_background_save(final, write)

    def _writer_group(self):
        """The process group the writer threads use: their collectives (DCP's plan exchange, the
        barriers) run beside the training's on the default group, so they get a gloo group of their
        own (the snapshot is in host memory). Created on the first background save, which every rank makes."""
        if not (dist.is_available() and dist.is_initialized()):
            return None
        if getattr(self, "_async_group", None) is None:
            self._async_group = dist.new_group(backend="gloo")
        return self._async_group

    @staticmethod
    def _write_shards(tmp: str, model_state, optim_state, group) -> None:
        import torch.distributed.checkpoint as dcp

        if model_state is not None:
            dcp.save(model_state, checkpoint_id=os.path.join(tmp, "model"), process_group=group)
        if optim_state is not None:
            dcp.save(optim_state, checkpoint_id=os.path.join(tmp, "optim"), process_group=group)

    def _save_small_files(self, tmp: str, rank: int, world_size: int, global_step: int) -> None:
        """Extra state (lr scheduler, RNG), `huggingface/` and the LoRA adapter (collective with hf_model)."""
        if "extra" in self.save_contents:
            self._save_extra_state(os.path.join(tmp, self._extra_state_name(world_size, rank)), global_step)
        self._save_huggingface(os.path.join(tmp, "huggingface"), rank)
        if is_peft_model(self.model):
            save_lora_adapter(self.model, os.path.join(tmp, ADAPTER_DIR))

    def _publish(self, tmp: str, final: str, rank: int, max_ckpt_to_keep: int | None, group) -> None:
        """Once every rank has written its part: rank 0 renames `tmp` to `final` and applies retention.
        Every rank learns whether that worked, so a failure is raised on all of them (none waits forever)."""
        _barrier(group)
        error = None
        if rank == 0:
            try:
                old = final + ".old"
                if os.path.exists(final):
                    shutil.rmtree(old, ignore_errors=True)
                    os.rename(final, old)
                    os.rename(tmp, final)
                    shutil.rmtree(old)
                else:
                    os.makedirs(os.path.dirname(final), exist_ok=True)
                    os.rename(tmp, final)
                self.register_checkpoint(final, max_ckpt_to_keep)
            except OSError as e:
                error = e
        if dist.is_available() and dist.is_initialized():
            device = "cpu" if group is not None else collective_device()  # the writer group is gloo
            ok = torch.tensor([0 if error is not None else 1], dtype=torch.int64, device=device)
            dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
            if error is None and not ok.item():
                raise OSError(f"rank 0 could not publish checkpoint {final} (its log has the cause)")
        if error is not None:
            raise error

    def _save_extra_state(self, file: str, global_step: int) -> None:
        extra = {
            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
            "rng": self.get_rng_state(),
            "global_step": global_step,
        }
        torch.save(extra, file)

    def _save_huggingface(self, hf_dir: str, rank: int) -> None:
        """Config, generation config and tokenizer on rank 0; full weights too when asked (collective)."""
        full_state = None
        hf_model = self.model.get_base_model() if is_peft_model(self.model) else self.model
        if "hf_model" in self.save_contents:
            from verl.utils.fsdp_utils import get_full_state_dict

            full_state = get_full_state_dict(self.model, rank0_only=True)
            if full_state and is_peft_model(self.model):
                full_state = dict(merge_lora_state(full_state.items(), lora_scalings(self.model)))
        if rank != 0:
            return
        os.makedirs(hf_dir, exist_ok=True)
        config = getattr(self.model, "config", None)
        if config is not None:
            config.save_pretrained(hf_dir)
        generation_config = getattr(self.model, "generation_config", None)
        if generation_config is not None:
            generation_config.save_pretrained(hf_dir)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(hf_dir)
        if full_state is not None:
            # an empty (meta) instance of the model class writes the weights HF-style: tied weights,
            # sharding of large files and the safetensors metadata are handled by save_pretrained
            with torch.device("meta"):
                shell = _unwrapped_class(hf_model)._from_config(config)
            shell.save_pretrained(hf_dir, state_dict=full_state)

    def load_checkpoint(self, local_path: str | None, hdfs_path: str | None = None, del_local_after_load=False):
        """Restore what `load_contents` lists from `local_path` (collective). None is a no-op."""
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        if local_path is None:
            return
        self.finish_pending_save()
        path = os.path.abspath(local_path)
        if not os.path.isdir(path) and os.path.isdir(path + ".old"):
            logger.warning(
                "checkpoint %s is missing but %s.old exists (a save was interrupted); loading it", path, path
            )
            path = path + ".old"
        if not os.path.isdir(path):
            raise FileNotFoundError(
                f"checkpoint directory {local_path!r} does not exist; check trainer.resume_from_path / "
                "trainer.default_local_dir, or set trainer.resume_mode=disable to start fresh"
            )
        rank, world_size = _rank_world()

        if "model" in self.load_contents:
            model_state = get_model_state_dict(self.model)
            dcp_load(model_state, self._require(path, "model"))
            set_model_state_dict(self.model, model_state)
        if "optimizer" in self.load_contents and self.optimizer is not None:
            optim_state = get_optimizer_state_dict(self.model, self.optimizer)
            dcp_load(optim_state, self._require(path, "optim"))
            set_optimizer_state_dict(self.model, self.optimizer, optim_state)
        if "extra" in self.load_contents:
            self._load_extra_state(path, rank, world_size)
        if del_local_after_load and rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        _barrier()

    @staticmethod
    def _require(path: str, name: str) -> str:
        sub = os.path.join(path, name)
        if not os.path.isdir(sub):
            raise FileNotFoundError(
                f"checkpoint {path!r} has no {name}/ directory (it was saved without it); remove {name!r} from "
                "checkpoint.load_contents"
            )
        return sub

    def _load_extra_state(self, path: str, rank: int, world_size: int) -> None:
        own = os.path.join(path, self._extra_state_name(world_size, rank))
        if os.path.exists(own):
            extra = torch_load(own, "checkpoint state file")
            self.load_rng_state(extra["rng"])
        else:
            saved = sorted(f for f in os.listdir(path) if f.startswith("extra_state_") and f.endswith("_rank_0.pt"))
            if not saved:
                raise FileNotFoundError(
                    f"checkpoint {path!r} has no extra_state_*.pt files; remove 'extra' from checkpoint.load_contents"
                )
            logger.warning("checkpoint %s was saved on another world size; restoring the lr scheduler only", path)
            extra = torch_load(os.path.join(path, saved[0]), "checkpoint state file")
        if self.lr_scheduler is not None and extra["lr_scheduler"] is not None:
            self.lr_scheduler.load_state_dict(extra["lr_scheduler"])
