"""Merge an FSDP checkpoint (`verl.utils.checkpoint.fsdp_checkpoint_manager` layout) into full weights.

The model lives in `<local_dir>/model/` as a torch.distributed.checkpoint (DCP) directory: one
`__<rank>_0.distcp` file per training rank plus a `.metadata` file that records, for every tensor,
its full shape, dtype and which byte ranges of which file hold which slice. The merger reads the
metadata, allocates each tensor at its full size on the CPU and asks DCP to fill it
(`dcp.load(..., no_dist=True)`): DCP reassembles the shards from however many ranks wrote them, in
this one process, without torch.distributed being initialised. Only the model is read; the
optimizer state (`optim/`) and the per-rank `extra_state_*.pt` files are ignored.

Peak memory is one copy of the full model in the checkpoint's dtype (plus one converted copy with
`--dtype`).
"""

from __future__ import annotations

import glob
import os
import warnings

import torch

from verl.model_merger.base_model_merger import BaseModelMerger, ModelMergerError, require_checkpoint_dir

__all__ = ["FSDPModelMerger"]

_EXPECTED_LAYOUT = (
    "model/ (the DCP shards __<rank>_0.distcp and .metadata), huggingface/ (config.json and the tokenizer files) "
    "and, optionally, optim/ and extra_state_world_size_<W>_rank_<r>.pt"
)


class FSDPModelMerger(BaseModelMerger):
    """Reads `model/` of a checkpoint written by `FSDPCheckpointManager` on any number of ranks."""

    @property
    def model_dir(self) -> str:
        return os.path.join(self.config.local_dir, "model")

    def check_checkpoint_layout(self) -> None:
        local_dir = self.config.local_dir
        require_checkpoint_dir(local_dir)
        if os.path.isfile(os.path.join(self.model_dir, ".metadata")):
            return
        present = sorted(os.listdir(local_dir))
        roles = [d for d in present if os.path.isfile(os.path.join(local_dir, d, "model", ".metadata"))]
        if os.path.isfile(os.path.join(local_dir, "dist_ckpt", "metadata.json")):
            hint = (
                "It holds dist_ckpt/ (megatron dist_checkpointing): it was written by the megatron backend "
                "(actor.strategy=megatron); merge it with --backend megatron"
            )
        elif roles:
            hint = (
                f"This looks like a global_step directory; pass the role's directory, e.g. "
                f"--local_dir {os.path.join(local_dir, roles[0])}"
            )
        elif glob.glob(os.path.join(local_dir, "model_world_size_*_rank_*.pt")):
            hint = (
                "It holds per-rank model_world_size_*_rank_*.pt files, the layout of older upstream verl versions, "
                "which this merger does not read; merge it with the verl version that wrote it"
            )
        elif glob.glob(os.path.join(local_dir, "huggingface", "*.safetensors")):
            hint = (
                "It has no model/ but full weights in huggingface/ (saved with checkpoint.save_contents=['hf_model']): "
                f"{os.path.join(local_dir, 'huggingface')} already is a Hugging Face model directory; use it directly"
            )
        else:
            hint = "Point --local_dir at .../global_step_<N>/actor (or critic) of a run's checkpoint directory"
        raise ModelMergerError(
            f"{local_dir!r} is not an FSDP checkpoint: a checkpoint directory holds {_EXPECTED_LAYOUT}; "
            f"this one holds {present or 'nothing'}. {hint}"
        )

    def load_state_dict(self) -> dict[str, torch.Tensor]:
        import torch.distributed.checkpoint as dcp

        from verl.utils.checkpoint.safe_load import dcp_load, dcp_metadata

        metadata = dcp_metadata(self.model_dir)
        state_dict = {
            name: torch.empty(meta.size, dtype=meta.properties.dtype)
            for name, meta in metadata.state_dict_metadata.items()
            if isinstance(meta, dcp.TensorStorageMetadata)
        }
        if not state_dict:
            raise ModelMergerError(
                f"the DCP checkpoint {self.model_dir!r} holds no tensors; it is not a model checkpoint"
            )
        num_shards = len(glob.glob(os.path.join(self.model_dir, "*.distcp")))
        print(f"loading {len(state_dict)} tensors from {num_shards} shard file(s) in {self.model_dir}")
        with warnings.catch_warnings():  # DCP warns that it loads in one process: exactly the intent here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            dcp_load(state_dict, self.model_dir, no_dist=True)
        return state_dict
