"""HF <-> megatron conversion of the multi-token-prediction layers (`verl.models.mcore.mtp`).

MiMo's HF layout (which transformers' Qwen2 model ignores on load), read straight from the
checkpoint's safetensors: `model.mtp_layers.{i}.` `token_layernorm` (megatron's enorm),
`hidden_layernorm` (hnorm), `input_proj` (eh_proj; its input is [hidden; embedding], the reverse of
megatron's [embedding; hidden], so the two column halves are swapped), `final_layernorm`, and a
Qwen2 decoder layer (`input_layernorm`, `self_attn.*`, `post_attention_layernorm`, `mlp.*`), which
converts exactly as a decoder layer does. Kept apart from `weights.py`, whose streams cover the
main model only (the rollout engines have no MTP heads).
"""

from __future__ import annotations

import copy
import glob
import os

import torch

from verl.models.mcore.mtp import HF_PREFIX, mtp_num_layers
from verl.models.mcore.weights import hf_to_mcore_state_dict

__all__ = ["hf_mtp_to_mcore_state_dict", "load_mtp_state_dict", "read_hf_mtp_tensors"]

# MiMo's names of the MTP-only norms -> megatron's
_MTP_NORMS = {
    "enorm.weight": "token_layernorm.weight",
    "hnorm.weight": "hidden_layernorm.weight",
    "final_layernorm.weight": "final_layernorm.weight",
}


def read_hf_mtp_tensors(model_path: str) -> dict[str, torch.Tensor]:
    """Every `model.mtp_layers.*` tensor of the safetensors files in `model_path`."""
    from safetensors import safe_open

    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(glob.glob(os.path.join(model_path, "*.safetensors"))):
        with safe_open(path, framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118  (safetensors' handle is not a mapping)
                if name.startswith(HF_PREFIX + "."):
                    tensors[name] = handle.get_tensor(name)
    return tensors


def hf_mtp_to_mcore_state_dict(
    hf_tensors: dict[str, torch.Tensor], hf_state_dict: dict, hf_config, tf_config, tp_rank: int, tp_size: int
) -> dict[str, torch.Tensor]:
    """The `mtp.layers.*` parameters of tensor-parallel rank `tp_rank` from MiMo-layout HF tensors.

    Each MTP transformer layer converts as decoder layer 0 of a one-layer model would
    (`hf_to_mcore_state_dict`, which also needs the main model's `hf_state_dict` for its embedding,
    norm and head); eh_proj (column-parallel: rows split over tp) gets its column halves swapped.
    """
    one_layer = copy.copy(tf_config)
    one_layer.num_layers, one_layer.mtp_num_layers = 1, None
    one_layer.pipeline_model_parallel_size, one_layer.virtual_pipeline_model_parallel_size = 1, None

    def hf(name: str) -> torch.Tensor:
        if name not in hf_tensors:
            raise KeyError(
                f"the HF checkpoint declares num_nextn_predict_layers={mtp_num_layers(hf_config)} but has no {name!r} "
                f"(MTP weights are read as MiMo names them, {HF_PREFIX}.<i>.*)"
            )
        return hf_tensors[name]

    out: dict[str, torch.Tensor] = {}
    for i in range(mtp_num_layers(hf_config)):
        src, dst = f"{HF_PREFIX}.{i}.", f"mtp.layers.{i}."
        for mcore_name, hf_name in _MTP_NORMS.items():
            out[dst + mcore_name] = hf(src + hf_name).clone()
        hidden_half, embedding_half = hf(src + "input_proj.weight").chunk(2, dim=1)
        out[dst + "eh_proj.weight"] = torch.cat([embedding_half, hidden_half], dim=1).chunk(tp_size)[tp_rank].clone()
        proxy = dict(hf_state_dict)
        prefix = src
        proxy.update({"model.layers.0." + k[len(prefix) :]: v for k, v in hf_tensors.items() if k.startswith(prefix)})
        layer = hf_to_mcore_state_dict(proxy, hf_config, one_layer, tp_rank, tp_size, 0, 1)
        for name, tensor in layer.items():
            if name.startswith("decoder.layers.0."):
                out[dst + "transformer_layer." + name[len("decoder.layers.0.") :]] = tensor
    return out


def load_mtp_state_dict(model_chunks, model_path: str, hf_state_dict: dict, hf_config) -> None:
    """Copy the HF checkpoint's MTP layers into the chunk that holds them (every parameter covered)."""
    from megatron.core import parallel_state as mpu

    hf_tensors = read_hf_mtp_tensors(model_path)
    tp_rank, tp_size = mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_world_size()
    for chunk in model_chunks:
        if getattr(chunk, "mtp", None) is None:
            continue
        shards = hf_mtp_to_mcore_state_dict(hf_tensors, hf_state_dict, hf_config, chunk.config, tp_rank, tp_size)
        params = {name: p for name, p in chunk.named_parameters() if name.startswith("mtp.")}
        if sorted(shards) != sorted(params):
            raise RuntimeError(
                f"HF -> megatron MTP conversion mismatch: unexpected {sorted(set(shards) - set(params))}, "
                f"missing {sorted(set(params) - set(shards))}"
            )
        with torch.no_grad():
            for name, tensor in shards.items():
                if params[name].shape != tensor.shape:
                    raise RuntimeError(f"{name}: converted shape {tuple(tensor.shape)} != {tuple(params[name].shape)}")
                params[name].copy_(tensor)
