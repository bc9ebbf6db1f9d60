"""Remove padding and Ulysses sequence parallelism for the SFT trainers (`main_sft`, the engine trainer's
FSDP passes), beside the padded loss (`sft_token_losses`): `SFTParallel.token_losses` picks the layout.

Upstream's two top-level keys of sft_trainer.yaml:

- `use_remove_padding=true`: each micro-batch's real tokens are packed into one row [1, T] with
  position ids restarting at 0 per original row (`verl.utils.remove_padding`); transformers detects
  the packing from the position ids, so no row attends to another. Labels and the loss mask are
  shifted within each padded row *before* packing, so the last token of a row never predicts the
  next row's first token. The per-token cross-entropy over the loss-masked tokens is the padded
  forward's (the data is right-padded: a loss-masked token is always preceded by a real one).
- `ulysses_sequence_parallel_size=sp > 1`: the ranks form a dp x sp grid of consecutive sp groups
  (dp = world / sp). Data is sharded over dp only (the ranks of an sp group read the same rows); each
  packed row is padded to a multiple of sp and split across the group (`verl.utils.ulysses`), and
  attention runs over the whole row through the all-to-all. Each rank computes the loss of its own
  slice only, so the group's losses partition the rows' tokens; nothing is gathered.

Gradient scaling: every rank backpropagates `slice_loss_sum / global_token_count * world` (world =
dp x sp), exactly what `accumulate_sft_gradients` does at sp=1. The all-to-all's backward delivers
each rank's share of every slice's gradient, so the sp ranks' gradients sum to the gradient of their
rows' loss, and FSDP's average over all dp x sp ranks divides the world factor away again. The one
thing sp changes is the token count: summed over all ranks, each token is counted sp times, so it
is divided by sp (`accumulate_sft_gradients(..., sp_size=sp)`). Validation sums slice-local losses
and counts, which need no correction.

FSDP keeps sharding the parameters over all ranks (one 1-D mesh), so a checkpoint written at one sp
size loads at any other. Left out: sliding-window attention and attention kernels other than sdpa
under sp > 1 (the patched attention is sdpa's), as in the PPO roles.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from verl.utils import ulysses
from verl.utils.remove_padding import packed_model_inputs, unpad_input, unpad_position_ids

SP_KEY = "ulysses_sequence_parallel_size"
REMOVE_PADDING_KEY = "use_remove_padding"


def check_sft_parallel(
    sp_size: int,
    use_remove_padding: bool,
    world_size: int | None,
    model_config=None,
    sp_key: str = SP_KEY,
    remove_padding_key: str = REMOVE_PADDING_KEY,
) -> None:
    """Refuse a Ulysses size the run cannot use, naming the keys (`sp_key`, `remove_padding_key`: how the
    trainer's config spells them), one line each. `world_size` None: the ranks are not known yet."""
    if sp_size < 1:
        raise ValueError(f"{sp_key}={sp_size} must be >= 1 (1: no sequence parallelism)")
    if sp_size == 1:
        return
    if not use_remove_padding:
        raise ValueError(
            f"{sp_key}={sp_size} needs {remove_padding_key}=true: Ulysses splits the packed (padding-free) "
            f"token sequence across ranks; set {remove_padding_key}=true or {sp_key}=1"
        )
    if world_size is not None and world_size % sp_size:
        raise ValueError(
            f"{sp_key}={sp_size} does not divide the {world_size} ranks: each sequence-parallel group takes "
            f"{sp_size} consecutive ranks; set it to a divisor of {world_size} or change --nproc_per_node"
        )
    if model_config is not None:
        ulysses.check_heads_divisible(model_config, sp_size)


@dataclass
class SFTParallel:
    """How this rank takes part in the run: its data-parallel coordinates and its sp group.

    Attributes:
        sp_size: ranks per sequence-parallel group (1: none).
        dp_size, dp_rank: the data-parallel grid (world / sp groups) and this rank's group in it.
        sp_group: the process group of this rank's sp peers (None when sp_size == 1).
        use_remove_padding: forward the packed layout.
    """

    sp_size: int = 1
    dp_size: int = 1
    dp_rank: int = 0
    sp_group: object = None
    use_remove_padding: bool = False

    sp_key: str = SP_KEY

    @classmethod
    def from_config(cls, config, device_name: str, mesh=None) -> SFTParallel:
        """`main_sft`'s keys (top-level `ulysses_sequence_parallel_size`, `use_remove_padding`; the model at
        `model.partial_pretrain`): see `build`. `mesh`: upstream's `ulysses_device_mesh`, when given."""
        return cls.build(
            int(config.get(SP_KEY, 1) or 1),
            bool(config.get(REMOVE_PADDING_KEY, False)),
            config.model.partial_pretrain,
            bool(config.model.get("trust_remote_code", False)),
            device_name,
            mesh=mesh,
        )

    @classmethod
    def build(
        cls,
        sp_size: int,
        use_remove_padding: bool,
        model_path: str,
        trust_remote_code: bool,
        device_name: str,
        mesh=None,
        sp_key: str = SP_KEY,
        remove_padding_key: str = REMOVE_PADDING_KEY,
    ) -> SFTParallel:
        """Check the keys (the head counts from the model's config.json) and build the dp x sp mesh;
        call on every rank (building the mesh is a collective) before the model is built. `mesh`: a
        ("dp", "sp") mesh the caller built already, used as it is."""
        world, rank = dist.get_world_size(), dist.get_rank()
        keys = {"sp_key": sp_key, "remove_padding_key": remove_padding_key}
        check_sft_parallel(sp_size, use_remove_padding, world, **keys)
        if sp_size == 1:
            return cls(1, world, rank, None, use_remove_padding, sp_key)
        from torch.distributed.device_mesh import init_device_mesh
        from transformers import AutoConfig

        from verl.utils.fs import copy_to_local

        model_config = AutoConfig.from_pretrained(
            copy_to_local(os.path.expanduser(model_path)), trust_remote_code=trust_remote_code
        )
        check_sft_parallel(sp_size, use_remove_padding, world, model_config, **keys)

        if mesh is None:
            mesh = init_device_mesh(device_name, (world // sp_size, sp_size), mesh_dim_names=("dp", "sp"))
        elif tuple(mesh.mesh_dim_names or ()) != ("dp", "sp") or mesh.size(1) != sp_size:
            raise ValueError(
                f"ulysses_device_mesh {tuple(mesh.shape)} {mesh.mesh_dim_names} does not match {sp_key}={sp_size}: "
                f'build it as init_device_mesh(device, ({world // sp_size}, {sp_size}), mesh_dim_names=("dp", "sp"))'
            )
        ulysses.patch_sdpa_attention()
        dp_rank, sp_group = mesh.get_local_rank("dp"), mesh.get_group("sp")
        return cls(sp_size, world // sp_size, dp_rank, sp_group, use_remove_padding, sp_key)

    def token_losses(self, model, micro_batch: dict[str, torch.Tensor], device) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed token loss, count) of `micro_batch`: the packed forward with `use_remove_padding` (at sp > 1
        this rank's slice of it), else the padded one."""
        if self.use_remove_padding:
            return packed_sft_token_losses(model, micro_batch, device, self.sp_group)
        return sft_token_losses(model, micro_batch, device)

    def check_model(self, model) -> None:
        """The sp forward goes through the patched sdpa attention; refuse any other implementation."""
        ulysses.check_attention(model.config, self.sp_size, self.sp_key)


def sft_token_losses(model, micro_batch: dict[str, torch.Tensor], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token cross-entropy of `model` over the loss-masked tokens of `micro_batch`
    (`input_ids`, `attention_mask`, `position_ids`, `loss_mask`, all [B, L]), and their count."""
    input_ids = micro_batch["input_ids"].to(device)
    loss_mask = micro_batch["loss_mask"][:, 1:].to(device)
    logits = model(
        input_ids=input_ids,
        attention_mask=micro_batch["attention_mask"].to(device),
        position_ids=micro_batch["position_ids"].to(device),
        use_cache=False,
    ).logits
    losses = torch.nn.functional.cross_entropy(
        logits[:, :-1].to(torch.promote_types(logits.dtype, torch.float32)).transpose(1, 2),
        input_ids[:, 1:],
        reduction="none",
    )
    return (losses * loss_mask).sum(), loss_mask.sum()


def masked_token_loss_sum(logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of `logits` [N, V] against `labels` [N] where `loss_mask` [N] is 1, computed
    in at least fp32."""
    if logits.dtype != torch.float64:
        logits = logits.float()
    losses = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
    return (losses * loss_mask).sum()


def packed_sft_token_losses(
    model, micro_batch: dict[str, torch.Tensor], device, sp_group=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sft_token_losses` in the packed layout: (summed next-token cross-entropy over the loss-masked
    tokens, their count) of `micro_batch` (`input_ids`, `attention_mask`, `position_ids`,
    `loss_mask`, all [B, L], right-padded). With an sp group of more than one rank: of this rank's
    slice of the packed row only (the group's slices partition the tokens)."""
    input_ids = micro_batch["input_ids"].to(device)
    attention_mask = micro_batch["attention_mask"].to(device)
    # shifted within each row before packing: position t predicts token t+1 of the same row
    labels = torch.roll(input_ids, shifts=-1, dims=1)
    loss_mask = torch.roll(micro_batch["loss_mask"].to(device), shifts=-1, dims=1)
    loss_mask[:, -1] = 0
    packed_ids, indices = unpad_input(input_ids, attention_mask)
    packed_pos = unpad_position_ids(micro_batch["position_ids"].to(device), indices)
    packed_labels = labels.reshape(-1).index_select(0, indices).unsqueeze(0)
    packed_mask = loss_mask.reshape(-1).index_select(0, indices).unsqueeze(0)
    sp_size = 1 if sp_group is None else dist.get_world_size(sp_group)
    if sp_size == 1:
        logits = model(**packed_model_inputs(model, packed_ids, packed_pos), use_cache=False).logits
    else:
        sp_rank = dist.get_rank(sp_group)
        output, _ = ulysses.forward_slice(model, packed_ids, packed_pos, sp_group)
        logits = output.logits
        # pad positions get label 0 and mask 0: no loss there
        packed_labels = ulysses.pad_and_slice_packed(packed_labels, packed_pos, sp_size, sp_rank)[0]
        packed_mask = ulysses.pad_and_slice_packed(packed_mask, packed_pos, sp_size, sp_rank)[0]
    return masked_token_loss_sum(logits[0], packed_labels[0], packed_mask[0]), packed_mask.sum()
