"""Merge a megatron checkpoint (`verl.utils.checkpoint.megatron_checkpoint_manager` layout) into full weights.

The weights live in `<local_dir>/dist_ckpt/`, a megatron dist_checkpointing directory whose tensors
carry their global (unsharded) shapes, next to the Adam moments (keys `optimizer.*`, not read).
The merger loads them the way training resumes, at another layout: in this one process it creates
a 1-rank gloo group (on a FileStore in a temporary directory: no port to pick), sets up megatron's
model-parallel groups at tp=pp=1, builds the model from `huggingface/config.json`, lets
`MegatronCheckpointManager` load the model (dist_checkpointing reshards from whatever layout
saved it) and converts it with `verl.models.mcore.mcore_to_hf_named_tensors`, the same exact
conversion the rollout weight sync uses. The group and megatron's state are torn down afterwards.

Design decisions:
- Reusing the training code path instead of re-implementing megatron's tensor layouts (fused
  q/k/v per query group, fused [gate; up], stacked layers, padded vocabulary) means the merger
  cannot drift from what training saved: any checkpoint the trainer can resume, it can merge.
- What to build is read from the checkpoint's tensor metadata, not from flags: the parameter
  dtype (a bf16 run merges to bf16 with `--dtype auto`) and whether the model is a critic (an
  `output_layer.bias`, the value head's bias, which no LM head has). The layer count and hidden
  size are checked against the config before loading, so a config from another model is a clear
  error rather than a failure deep inside megatron. A critic's saved config is its causal LM's, so
  the merged critic's config gets `num_labels=1` to match its one-output value head.
- A LoRA run's checkpoint (a `lora_config.json` beside `dist_ckpt/`) is merged: the adapters are
  put on the model before loading, and the conversion yields `W + alpha/rank * B @ A`.
- Peak memory is two copies of the full model: the megatron model and the merged state dict.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile

import torch

from verl.model_merger.base_model_merger import BaseModelMerger, ModelMergerError, require_checkpoint_dir

__all__ = ["MegatronModelMerger", "get_dynamic_pipeline_shards"]

DIST_CKPT_DIR = "dist_ckpt"  # as in verl.utils.checkpoint.megatron_checkpoint_manager (not imported: heavy)
_EXPECTED_LAYOUT = (
    "dist_ckpt/ (megatron dist_checkpointing: metadata.json, .metadata, common.pt and __<rank>_<i>.distcp), "
    "huggingface/ (config.json and the tokenizer files) and extra_state_world_size_<W>_rank_<r>.pt"
)
_VALUE_HEAD_KEY = "output_layer.bias"


def get_dynamic_pipeline_shards(layer_num: int, pp_size: int) -> list[int]:
    """Layers per pipeline stage for `layer_num` layers on `pp_size` stages, as even as possible.

    The middle stages all get the same count m; the first and last stages split the remainder (the
    first taking the smaller half), each getting at least one layer and at most m, because those
    stages also hold the embedding and the output head. Among the valid m, the one whose first stage
    is closest to m wins (the smallest such m on a tie): 10 layers on 4 stages -> [2, 3, 3, 2].
    """
    if pp_size < 1:
        raise ValueError(f"pp_size must be at least 1, got {pp_size}")
    if layer_num < pp_size:
        raise ValueError(f"{layer_num} layers cannot fill {pp_size} pipeline stages; every stage needs one")
    if pp_size == 1:
        return [layer_num]
    if pp_size == 2:
        return [layer_num // 2, layer_num - layer_num // 2]
    middle_stages = pp_size - 2
    best = None
    for middle in range(1, layer_num + 1):
        ends = layer_num - middle * middle_stages
        first, last = ends // 2, ends - ends // 2
        if 0 < first <= middle and 0 < last <= middle and (best is None or abs(first - middle) < best[0]):
            best = (abs(first - middle), [first] + [middle] * middle_stages + [last])
    if best is None:
        raise ValueError(f"no pipeline split of {layer_num} layers over {pp_size} stages keeps the ends <= the middle")
    return best[1]


@contextlib.contextmanager
def _single_rank_megatron():
    """A 1-rank torch.distributed group (unless one exists) with megatron's groups at tp=pp=1, torn down on exit."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from verl.utils.megatron.parallel_state import destroy_model_parallel, initialize_model_parallel

    with contextlib.ExitStack() as stack:
        if not dist.is_initialized():
            store_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="verl_model_merger_"))
            store = dist.FileStore(os.path.join(store_dir, "store"), 1)
            dist.init_process_group("gloo", store=store, rank=0, world_size=1)
            stack.callback(dist.destroy_process_group)
        elif dist.get_world_size() != 1:
            raise ModelMergerError(
                f"the megatron merger runs in one process, but torch.distributed is already initialised with "
                f"{dist.get_world_size()} ranks; run `python -m verl.model_merger` as its own process"
            )
        if not mpu.model_parallel_is_initialized():
            initialize_model_parallel(1, 1)
            stack.callback(destroy_model_parallel)
        else:
            initialize_model_parallel(1, 1)  # raises unless the existing groups are tp=pp=1
        yield


class MegatronModelMerger(BaseModelMerger):
    """Reads `dist_ckpt/` of a checkpoint written by `MegatronCheckpointManager` at any tp/pp/dp layout."""

    @property
    def dist_ckpt_dir(self) -> str:
        return os.path.join(self.config.local_dir, DIST_CKPT_DIR)

    def check_checkpoint_layout(self) -> None:
        local_dir = self.config.local_dir
        require_checkpoint_dir(local_dir)
        if os.path.isfile(os.path.join(self.dist_ckpt_dir, "metadata.json")):
            return
        present = sorted(os.listdir(local_dir))
        roles = [d for d in present if os.path.isfile(os.path.join(local_dir, d, DIST_CKPT_DIR, "metadata.json"))]
        if os.path.isfile(os.path.join(local_dir, "model", ".metadata")):
            hint = (
                "It holds model/ with DCP shards: it was written by the FSDP backend (actor.strategy=fsdp or fsdp2); "
                "merge it with --backend fsdp"
            )
        elif roles:
            hint = (
                f"This looks like a global_step directory; pass the role's directory, e.g. "
                f"--local_dir {os.path.join(local_dir, roles[0])}"
            )
        elif (
            present and not os.path.isdir(self.dist_ckpt_dir) and os.path.isdir(os.path.join(local_dir, "huggingface"))
        ):
            hint = (
                "It has no dist_ckpt/: the model was not saved (checkpoint.save_contents without 'model'); "
                "if huggingface/ holds model.safetensors (save_contents with 'hf_model'), use that directory directly"
            )
        else:
            hint = "Point --local_dir at .../global_step_<N>/actor (or critic) of a run's checkpoint directory"
        raise ModelMergerError(
            f"{local_dir!r} is not a megatron checkpoint: a checkpoint directory holds {_EXPECTED_LAYOUT}; "
            f"this one holds {present or 'nothing'}. {hint}"
        )

    def _model_metadata(self) -> dict:
        """Global shape and dtype of every model tensor in dist_ckpt/ (the Adam moments left out)."""
        from megatron.core import dist_checkpointing

        metadata = dist_checkpointing.load_tensors_metadata(self.dist_ckpt_dir)
        model = {key: meta for key, meta in metadata.items() if not key.startswith("optimizer.")}
        if not model:
            raise ModelMergerError(
                f"{self.dist_ckpt_dir!r} holds only optimizer state (it was saved with checkpoint.save_contents "
                "without 'model'); there are no weights to merge"
            )
        return model

    def _check_config_fits(self, hf_config, metadata: dict) -> None:
        expected = {
            "decoder.final_layernorm.weight": (hf_config.hidden_size,),
            "decoder.layers.self_attention.linear_proj.weight": (hf_config.num_hidden_layers,),
        }
        for key, shape in expected.items():
            got = tuple(metadata[key].global_shape)[: len(shape)] if key in metadata else None
            if got is None and key.startswith("decoder.layers."):
                # layers of different kinds (DeepSeek-V3's dense and MoE layers) are saved one key per layer
                suffix = key[len("decoder.layers.") :]
                count = sum(f"decoder.layers.{i}.{suffix}" in metadata for i in range(len(metadata)))
                got = (count,) if count else None
            if got != shape:
                raise ModelMergerError(
                    f"{os.path.join(self.hf_model_config_path, 'config.json')} does not describe the checkpoint in "
                    f"{self.dist_ckpt_dir!r}: {key} has shape {got} there, the config implies {shape} "
                    "(num_hidden_layers, hidden_size). Check that huggingface/config.json belongs to this checkpoint"
                )

    def load_state_dict(self) -> dict[str, torch.Tensor]:
        from transformers import AutoConfig

        from verl.models.mcore import build_model_chunks, hf_to_mcore_config, mcore_to_hf_named_tensors
        from verl.utils.checkpoint.megatron_checkpoint_manager import LORA_CONFIG_FILE, MegatronCheckpointManager

        # the config as saved: --tie-word-embedding only changes how the merged model is written
        hf_config = AutoConfig.from_pretrained(self.hf_model_config_path)
        metadata = self._model_metadata()
        self._check_config_fits(hf_config, metadata)
        value_head = _VALUE_HEAD_KEY in metadata
        dtype = metadata["decoder.final_layernorm.weight"].dtype
        print(
            f"loading a megatron {'critic (value head)' if value_head else 'causal LM'} ({dtype}) "
            f"from {self.dist_ckpt_dir}"
        )
        with _single_rank_megatron():
            tf_config = hf_to_mcore_config(hf_config, None, dtype)
            chunks = build_model_chunks(hf_config, tf_config, value_head=value_head)
            lora_path = os.path.join(self.config.local_dir, LORA_CONFIG_FILE)
            if os.path.isfile(lora_path):  # a LoRA run: the adapters are loaded too and merged on the way out
                from verl.models.mcore.lora import apply_lora

                with open(lora_path) as f:
                    apply_lora(chunks, json.load(f))
            manager = MegatronCheckpointManager(
                chunks, checkpoint_config={"save_contents": ["model"], "load_contents": ["model"]}
            )
            manager.load_checkpoint(self.config.local_dir)
            state_dict = {
                name: tensor.detach().cpu()
                for name, tensor in mcore_to_hf_named_tensors(chunks, hf_config, value_head=value_head)
            }
        if value_head:
            # a config saved as the causal LM's (num_labels=2 by default) still has a one-output head
            self.model_config.num_labels = 1
        elif hf_config.tie_word_embeddings:
            # the conversion yields a tied head once, as HF files store it; the full state dict names it twice
            state_dict["lm_head.weight"] = state_dict["model.embed_tokens.weight"]
        return state_dict
