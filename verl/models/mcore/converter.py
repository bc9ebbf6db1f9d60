"""Convert an HF Qwen2/Llama checkpoint into a megatron dist checkpoint, once, ahead of training.

    python -m verl.models.mcore.converter --hf_model_path /models/Qwen2.5-7B --output_path /ckpt/qwen7b_mcore

Then train with `actor_rollout_ref.actor.megatron.use_dist_checkpointing=true
actor_rollout_ref.actor.megatron.dist_checkpointing_path=/ckpt/qwen7b_mcore` (and the same for
`ref` and `critic`): each rank reads only its own shards instead of the whole HF checkpoint.
`scripts/converter_hf_to_mcore.py` takes the same arguments (upstream's script name).

The conversion runs in one process (tp=1, pp=1, gloo) on CPU: dist checkpoints are independent of
the layout, so the output loads at any tensor / pipeline / virtual-pipeline / context layout.
Weights are converted exactly as at start-up (`verl.models.mcore.load_hf_state_dict`), in the
HF checkpoint's dtype unless `--dtype` says otherwise.
"""

from __future__ import annotations

import argparse
import os

import torch

__all__ = ["convert_hf_to_mcore", "main"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def convert_hf_to_mcore(
    hf_model_path: str, output_path: str, dtype: str | None = None, trust_remote_code: bool = False, prefix: str = ""
) -> None:
    """Write the HF model at `hf_model_path` as a megatron dist checkpoint at `output_path`.

    Needs an initialised torch.distributed world of one rank, or none (then a one-rank gloo world
    is created and torn down here). `prefix` goes in front of every key (megatron's
    `sharded_state_dict(prefix=...)`; `megatron.dist_checkpointing_prefix` when loading).
    """
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from verl.models.mcore import build_model_chunks, hf_to_mcore_config, load_hf_state_dict
    from verl.single_controller.base.worker import get_free_port
    from verl.utils.megatron.parallel_state import destroy_model_parallel, initialize_model_parallel
    from verl.utils.model import load_causal_lm, load_model_config

    if os.path.exists(output_path) and os.listdir(output_path):
        raise FileExistsError(f"--output_path {output_path} exists and is not empty; choose a new directory")
    own_world = not dist.is_initialized()
    if own_world:
        # get_free_port, not bind(0): a port of the ephemeral range can be taken by any outgoing
        # connection between the pick and gloo's bind (the EADDRINUSE race of worker start-up)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{get_free_port()}", rank=0, world_size=1)
    elif dist.get_world_size() != 1:
        raise RuntimeError("convert_hf_to_mcore runs in one process; call it outside a multi-rank world")
    try:
        hf_config = load_model_config(hf_model_path, trust_remote_code)
        if dtype is None:
            dtype = str(getattr(hf_config, "torch_dtype", None) or getattr(hf_config, "dtype", None) or "float32")
            dtype = dtype.replace("torch.", "")
        if dtype not in _DTYPES:
            raise ValueError(f"--dtype {dtype}: choose one of {sorted(_DTYPES)}")
        initialize_model_parallel()
        tf_config = hf_to_mcore_config(hf_config, None, _DTYPES[dtype])
        (chunk,) = build_model_chunks(hf_config, tf_config)
        hf_model = load_causal_lm(hf_model_path, torch_dtype=_DTYPES[dtype], trust_remote_code=trust_remote_code)
        state = dict(hf_model.state_dict())
        if getattr(hf_config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        load_hf_state_dict([chunk], state, hf_config)
        del hf_model, state
        os.makedirs(output_path, exist_ok=True)
        dist_checkpointing.save(chunk.sharded_state_dict(prefix=prefix), output_path)
        destroy_model_parallel()
    finally:
        if own_world:
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf_model_path", required=True, help="HF model directory (Qwen2 or Llama)")
    parser.add_argument("--output_path", required=True, help="new directory for the dist checkpoint")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default=None, help="default: the HF config's dtype")
    parser.add_argument("--prefix", default="", help="key prefix (megatron.dist_checkpointing_prefix)")
    parser.add_argument("--trust_remote_code", action="store_true")
    args = parser.parse_args(argv)
    convert_hf_to_mcore(args.hf_model_path, args.output_path, args.dtype, args.trust_remote_code, args.prefix)
    print(f"wrote a megatron dist checkpoint of {args.hf_model_path} to {args.output_path}")


if __name__ == "__main__":
    main()
