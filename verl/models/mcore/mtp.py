"""Multi-token prediction (MTP) layers on the megatron GPTModel: build, weights, and the training loss.

A model with `num_nextn_predict_layers = n > 0` in its HF config (MiMo; DeepSeek-V3's field name)
carries n MTP layers after the decoder. Depth k (1..n) combines the previous depth's hidden state at
column t (depth 0: the decoder's final, normed output) with the embedding of token t + k, and
predicts token t + k + 1 through the shared LM head: megatron-core's `MultiTokenPredictionBlock`
(enorm, hnorm, eh_proj over [embedding; hidden], one transformer layer, a final norm).

What `actor_rollout_ref.model.mtp` does here (upstream's keys and meaning):
- `enable`: the actor's model is built with its MTP layers, loaded from the HF checkpoint and
  kept in its megatron checkpoints (`mtp.layers.*`); the reference model is built without them.
- `enable_train`: each training forward also runs the MTP layers and adds
  `mtp_loss_scaling_factor / n * sum_k mean_k` to the micro-batch's loss, divided by the number
  of micro-batches of the mini-batch (megatron's `MTPLossAutoScaler` weighting in upstream). `mean_k`
  is depth k's cross-entropy, on the raw logits (no sampling temperature), averaged over the
  micro-batch's response tokens that depth k predicts (token t + k + 1 a response token under
  `response_mask`). Logged per depth as `mtp_losses/mtp_{k}_loss` (the unscaled mean), as upstream.
  Log-prob passes (no gradient) never run the MTP layers.
- `detach_encoder`: the MTP layers' inputs (the decoder's hidden state and the token embeddings)
  are detached, so the MTP loss trains the MTP layers and the shared LM head only; the decoder
  and the embedding get exactly the gradient they get without MTP (with tied embeddings the
  embedding is the LM head, and learns from it as a head).

Design decisions:
- Megatron's own `GPTModel._postprocess` runs MTP only together with its language-model loss
  (it returns the loss instead of the logits when given labels) and logs through a CUDA-only
  tracker. Models built with MTP layers get `_postprocess_with_mtp` instead: the main logits
  exactly as without MTP, plus each depth's logits kept on the model for the actor's loss
  (`MtpTraining.take_logits`), the pattern of the MoE router's recorded logits.
- One deliberate difference from upstream's mask: upstream counts the column whose rolled label
  is the token after a response's last real token (padding, or the next packed sequence's garbage);
  here only real response tokens are targets.
- HF layout: MiMo's `model.mtp_layers.{i}.*` (`verl.models.mcore.mtp_weights`).
- The layers are built only when the caller asks (`tf_config.mtp_num_layers`, which the engine sets
  for `mtp.enable` on a Qwen2-architecture model): otherwise a Qwen2 checkpoint's MTP weights are
  ignored, as HF's model ignores them (a DeepSeek-V3 config declaring MTP layers is refused by
  `verl.models.mcore.deepseek`).
- Pipeline parallelism: megatron builds the MTP layers on the last stage, with a copy of the
  embedding there (loaded from the HF embedding, `verl.models.mcore.weights`); the copies'
  gradients are summed over the embedding group (first and last stage) after each backward, as
  for a tied LM head (`megatron_actor._sum_embedding_copies`), so both stay equal. Stages before
  the last carry no MTP state (`configure_mtp` returns None there).
- Context parallelism: megatron-core's `roll_tensor` exchanges each chunk's boundary token with the
  neighbouring context-parallel rank (its receive buffer is put on the CPU by
  `verl.utils.megatron.cpu_compat`); `mtp_loss` gathers the per-token log-probs over the ranks, as the
  policy loss does.
- Limits, refused where the model is built: virtual pipeline stages (megatron's MTP placement per
  virtual stage is not wired here). The HF export (`mcore_to_hf_named_tensors`: rollout weight sync,
  `hf_model` checkpoints, the model merger) streams the main model only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from verl.utils.megatron.tensor_parallel import vocab_parallel_log_probs_and_entropy

__all__ = [
    "HF_PREFIX",
    "MtpTraining",
    "build_mtp_block_spec",
    "check_mtp_layout",
    "configure_mtp",
    "find_mtp_training",
    "install_postprocess",
    "mtp_loss",
    "mtp_num_layers",
]

HF_PREFIX = "model.mtp_layers"
_STATE_ATTR = "_verl_mtp"


def mtp_num_layers(hf_config) -> int:
    """The number of MTP layers the HF config declares (0 without the field)."""
    return int(getattr(hf_config, "num_nextn_predict_layers", 0) or 0)


def check_mtp_layout(tf_config) -> None:
    """Refuse the layouts MTP is not wired for (see the module docstring)."""
    vpp = tf_config.virtual_pipeline_model_parallel_size or 1
    if vpp > 1:
        raise ValueError(
            f"actor_rollout_ref.model.mtp.enable=true with actor.megatron.virtual_pipeline_model_parallel_size={vpp}: "
            "multi-token prediction is implemented without virtual pipeline stages (tensor, pipeline and context "
            "parallelism work); set virtual_pipeline_model_parallel_size=null or mtp.enable=false"
        )


def build_mtp_block_spec(tf_config, layer_spec, norm, vp_stage: int | None = None):
    """Megatron's MTP block spec for the local `layer_spec`, with `norm` (the backend's RMSNorm) for
    every MTP norm; None on a pipeline stage other than the last (megatron keeps the MTP layers there)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    check_mtp_layout(tf_config)
    block = get_gpt_mtp_block_spec(tf_config, layer_spec, use_transformer_engine=False, vp_stage=vp_stage)
    if block is None:
        return None
    for spec in block.layer_specs:
        spec.submodules.enorm = spec.submodules.hnorm = spec.submodules.layer_norm = norm
    return block


@dataclass
class MtpTraining:
    """What a model with MTP layers does with them: kept on the GPTModel (`configure_mtp`)."""

    num_layers: int
    enable_train: bool = False
    scaling_factor: float = 0.1
    detach_encoder: bool = False
    logits: list = field(default_factory=list)

    def take_logits(self) -> list[torch.Tensor]:
        """The depths' logits [B, L, V_local] of the forward that just ran (empty when none ran)."""
        logits, self.logits = self.logits, []
        return logits


def install_postprocess(model, num_layers: int) -> None:
    """Give a GPTModel built with MTP layers `_postprocess_with_mtp` (MTP off until `configure_mtp`)."""
    object.__setattr__(model, _STATE_ATTR, MtpTraining(num_layers))
    model._postprocess = _postprocess_with_mtp.__get__(model, type(model))
    if not model.pre_process:
        model.sharded_state_dict = _with_dp_cp_group(model.sharded_state_dict)


def _with_dp_cp_group(sharded_state_dict):
    """The MTP stage's `sharded_state_dict`, given megatron's default `metadata`: megatron-core 0.16.1's
    GPTModel ties a later stage's embedding copy to the first stage's with `metadata["dp_cp_group"]`,
    read from the caller's metadata (None when not given) rather than the defaulted one its parent
    class builds."""
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

    def with_group(prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        return sharded_state_dict(prefix, sharded_offsets, ensure_metadata_has_dp_cp_group(metadata))

    return with_group


def configure_mtp(model_chunks, enable_train: bool, scaling_factor: float, detach_encoder: bool) -> MtpTraining | None:
    """Switch MTP training on the chunk holding the MTP layers; returns its state (shared with the
    actor), or None on a pipeline stage that holds none."""
    states = [getattr(chunk, _STATE_ATTR) for chunk in model_chunks if hasattr(chunk, _STATE_ATTR)]
    if not states:
        if any(chunk.config.mtp_num_layers for chunk in model_chunks):
            return None  # a pipeline stage before the last: the MTP layers live on the last one
        raise ValueError("configure_mtp: the model was built without MTP layers")
    (state,) = states
    state.enable_train, state.scaling_factor, state.detach_encoder = enable_train, scaling_factor, detach_encoder
    if detach_encoder:
        for chunk in model_chunks:
            for layer in getattr(getattr(chunk, "mtp", None), "layers", []):
                layer._get_embeddings = _detached_inputs(layer._get_embeddings)
    return state


def find_mtp_training(model_chunks) -> MtpTraining | None:
    """The chunks' MTP state when one trains its MTP layers, else None."""
    for chunk in model_chunks:
        state = getattr(chunk, _STATE_ATTR, None)
        if state is not None and state.enable_train:
            return state
    return None


def _detached_inputs(get_embeddings):
    """`MultiTokenPredictionLayer._get_embeddings` with its two outputs the loss could reach the trunk
    through (the token embeddings and the incoming hidden state) cut from the graph."""

    def get_detached(*args, **kwargs):
        input_ids, position_ids, decoder_input, hidden_states = get_embeddings(*args, **kwargs)
        return input_ids, position_ids, decoder_input.detach(), hidden_states.detach()

    return get_detached


def _postprocess_with_mtp(
    self,
    hidden_states,
    input_ids,
    position_ids,
    labels,
    rotary_pos_emb,
    rotary_pos_cos,
    rotary_pos_sin,
    mtp_in_postprocess=None,
    loss_mask=None,
    decoder_input=None,
    attention_mask=None,
    inference_params=None,
    packed_seq_params=None,
    sequence_len_offset=None,
    runtime_gather_output=None,
    extra_block_kwargs=None,
    inference_context=None,
):
    """GPTModel's postprocess for this backend: logits [B, S, V_local]; in a training forward of a
    model that trains its MTP layers, each depth's logits are also kept (`MtpTraining.logits`)."""
    if labels is not None or inference_context is not None:
        raise NotImplementedError("this backend computes its losses itself and runs no inference context")
    output_weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
    state: MtpTraining = getattr(self, _STATE_ATTR)
    if mtp_in_postprocess and state.enable_train and self.training and torch.is_grad_enabled():
        stacked = self.mtp(
            input_ids=input_ids,
            position_ids=position_ids,
            hidden_states=hidden_states,
            attention_mask=attention_mask,
            rotary_pos_emb=rotary_pos_emb,
            rotary_pos_cos=rotary_pos_cos,
            rotary_pos_sin=rotary_pos_sin,
            packed_seq_params=packed_seq_params,
            sequence_len_offset=sequence_len_offset,
            embedding=self.embedding,
            **(extra_block_kwargs or {}),
        )
        depths = torch.chunk(stacked, 1 + state.num_layers, dim=0)[1:]
        state.logits = []
        for depth in depths:
            logits, _ = self.output_layer(depth, weight=output_weight, runtime_gather_output=runtime_gather_output)
            state.logits.append(logits.transpose(0, 1))
    if not self.post_process:
        return hidden_states
    logits, _ = self.output_layer(hidden_states, weight=output_weight, runtime_gather_output=runtime_gather_output)
    return logits.transpose(0, 1).contiguous()


def mtp_loss(
    depth_logits: list[torch.Tensor],
    labels: torch.Tensor,
    response_index: torch.Tensor,
    response_mask: torch.Tensor,
    vocab_size: int,
    local=None,
    full=None,
) -> list[torch.Tensor]:
    """Each depth's mean cross-entropy (0-d) over the response tokens it predicts.

    `depth_logits[k-1]` [B, L_local, V_local] are depth k's logits (vocabulary shards, and this
    context-parallel rank's columns); `labels` [B, L] the next token of each left-aligned column
    (`AlignedBatch.labels`); `response_index` [B, R] the column predicting each response token and
    `response_mask` [B, R] which are real. Depth k at column c predicts `labels[:, c + k]`, so
    response token j is its target at column `response_index[:, j] - k` (when that column exists).
    Under context parallelism `local` takes this rank's columns of a [B, L] tensor and `full` gathers
    [B, L_local] values back into [B, L] (`AlignedBatch.local`/`full`; identities by default).
    """
    local = local or (lambda tensor: tensor)
    full = full or (lambda tensor: tensor)
    batch, length = labels.shape
    means = []
    for k, logits in enumerate(depth_logits, start=1):
        target = torch.zeros_like(labels)
        target[:, : length - k] = labels[:, k:]
        columns = response_index - k
        valid = response_mask.bool() & (columns >= 0)
        mask = torch.zeros(batch, length, dtype=torch.float32, device=labels.device)
        rows = torch.arange(batch, device=labels.device)[:, None].expand_as(columns)
        mask[rows[valid], columns[valid]] = 1.0
        log_probs, _ = vocab_parallel_log_probs_and_entropy(logits, local(target), vocab_size)
        log_probs = full(log_probs)
        means.append(-(log_probs.float() * mask).sum() / mask.sum().clamp(min=1.0))
    return means
