"""Loss functions of the training API (upstream's `verl.workers.utils.losses`).

Each is `loss_fn(config, model_output, data, dp_group=None) -> (loss, metrics)`: bind `config`
with `functools.partial` and hand it to `TrainingWorker.set_loss_fn` (or an engine's
`train_batch` / `infer_batch`). The engine calls it once per micro-batch with

- `model_output`: the micro-batch's per-token outputs as jagged tensors [b, j] (`log_probs`, with
  `calculate_entropy` also `entropy`; a value model's `values`), position t of a row holding the
  value for the row's token t + 1 (see `verl.workers.utils.padding`);
- `data`: the micro-batch, with the engine's batch-wide counts `dp_size`, `batch_num_tokens` (the
  whole batch's `loss_mask` tokens over every data-parallel rank) and `global_batch_size`.

Each loss is normalised by those global counts and multiplied by `dp_size`, so the engine
backpropagates each micro-batch's loss as it is and the gradients averaged over the ranks are
those of the whole batch's mean, however the batch is cut into ranks and micro-batches. The
returned `metrics` hold plain numbers or `verl.utils.metric.Metric`s, which say how the
worker combines the micro-batches' values.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from verl.algorithms.aggregation import agg_loss
from verl.algorithms.kl import kl_penalty
from verl.algorithms.policy_losses import get_policy_loss_fn
from verl.algorithms.value_losses import compute_value_loss
from verl.utils import tensordict_utils as tu
from verl.utils.metric import AggregationType, Metric
from verl.utils.torch_functional import masked_mean, masked_sum

__all__ = ["ppo_loss", "response_outputs", "sft_loss", "value_loss"]


def response_outputs(output: torch.Tensor, data: TensorDict) -> torch.Tensor:
    """A jagged per-token output [b, j] of a left-right padded RL micro-batch (repacked with
    `left_right_2_no_padding`), as the padded response block [b, R] of `response_mask`: for each
    row, the outputs at the positions that predict its response tokens, zeros after them.

    A row's packed tokens are its prompt then its response; the response is the real tokens of
    the last R columns of `attention_mask`, and its k-th token is predicted at packed position
    (end - n + k - 1), n the response length."""
    input_ids = data["input_ids"]
    values = output.values() if output.is_nested else output
    response_len = data["response_mask"].shape[-1]
    n = data["attention_mask"][:, -response_len:].sum(dim=-1).to(values.device)
    ends = input_ids.offsets()[1:].to(values.device) if input_ids.is_nested else n.cumsum(0)
    if int(ends[-1]) != values.shape[0]:
        raise ValueError(
            f"the model output has {values.shape[0]} token positions but the micro-batch has {int(ends[-1])} tokens"
        )
    k = torch.arange(response_len, device=values.device)
    positions = (ends - n - 1).unsqueeze(-1) + k
    valid = k < n.unsqueeze(-1)
    gathered = values[positions.clamp(min=0, max=values.shape[0] - 1)]
    return torch.where(valid, gathered, torch.zeros_like(gathered))


def _counts(data: TensorDict) -> tuple[int, object, object]:
    return tu.get(data, "dp_size", 1), tu.get(data, "batch_num_tokens", None), tu.get(data, "global_batch_size", None)


def sft_loss(config, model_output, data: TensorDict, dp_group=None):
    """Negative log-likelihood of the `loss_mask` tokens, averaged over the whole batch's tokens.

    `loss_mask` is either jagged like `input_ids` (an SFT batch without padding: 1 on the tokens to
    learn) or the padded response mask [b, R] of an RL batch (the responses are learned)."""
    dp_size, batch_num_tokens, _ = _counts(data)
    log_probs = model_output["log_probs"]
    loss_mask = data["loss_mask"]
    if loss_mask.is_nested:
        # position t predicts token t + 1: shift the mask one token left to line it up
        mask = torch.roll(loss_mask.values(), shifts=-1, dims=0)
        token_log_probs = log_probs.values()
    else:
        mask = data["response_mask"]
        token_log_probs = response_outputs(log_probs, data)
    mask = mask.to(token_log_probs.dtype)
    if batch_num_tokens is None:
        batch_num_tokens = mask.sum().clamp(min=1)
    loss = -masked_sum(token_log_probs, mask) / batch_num_tokens * dp_size
    return loss, {}


def ppo_loss(config, model_output, data: TensorDict, dp_group=None):
    """The actor's PPO loss as its `update_actor` computes it: `actor.policy_loss.loss_mode`'s policy
    loss on the responses, minus `entropy_coeff` times the entropy (when the engine computed it), plus
    `kl_loss_coef` times the KL to `ref_log_prob` with `use_kl_loss`; every term aggregated with
    `loss_agg_mode` over the whole batch (the counts go through `config.global_batch_info`).

    `config` is the actor's `ActorConfig`; `data` needs `old_log_probs`, `advantages`,
    `response_mask` (and `ref_log_prob` with `use_kl_loss`, optionally `rollout_is_weights`)."""
    dp_size, batch_num_tokens, global_batch_size = _counts(data)
    info = config.global_batch_info
    info.update(dp_size=dp_size, batch_num_tokens=batch_num_tokens, global_batch_size=global_batch_size)
    # globally normalised terms are reported divided by dp_size: their SUM over every micro-batch of every
    # rank is then the batch's value; a term of one micro-batch alone is a MEAN
    globally_normalised = dp_size > 1 or batch_num_tokens is not None or global_batch_size is not None
    aggregation = AggregationType.SUM if globally_normalised else AggregationType.MEAN

    def term(value: torch.Tensor) -> Metric:
        return Metric(aggregation, value.detach() / (dp_size if globally_normalised else 1))

    agg_kwargs = dict(info, loss_scale_factor=config.loss_scale_factor)

    log_prob = response_outputs(model_output["log_probs"], data)
    response_mask = data["response_mask"].to(torch.bool)
    loss_mode = config.policy_loss.get("loss_mode", "vanilla")
    pg_loss, pg_metrics = get_policy_loss_fn(loss_mode)(
        old_log_prob=data["old_log_probs"],
        log_prob=log_prob,
        advantages=data["advantages"],
        response_mask=response_mask,
        loss_agg_mode=config.loss_agg_mode,
        config=config,
        rollout_is_weights=data.get("rollout_is_weights", None),
    )
    metrics = {
        (key if key.startswith("actor/") else f"actor/{key}"): Metric(AggregationType.MEAN, value)
        for key, value in pg_metrics.items()
    }
    metrics["actor/pg_loss"] = term(pg_loss)
    loss = pg_loss
    if "entropy" in set(model_output.keys()):
        entropy = response_outputs(model_output["entropy"], data)
        entropy_loss = agg_loss(entropy, response_mask, config.loss_agg_mode, **agg_kwargs)
        loss = loss - config.entropy_coeff * entropy_loss
        metrics["actor/entropy_loss"] = term(entropy_loss)
    if config.use_kl_loss:
        kld = kl_penalty(log_prob, data["ref_log_prob"], config.kl_loss_type)
        kl_loss = agg_loss(kld, response_mask, config.loss_agg_mode, **agg_kwargs)
        loss = loss + config.kl_loss_coef * kl_loss
        metrics["kl_loss"] = term(kl_loss)
        metrics["kl_coef"] = config.kl_loss_coef
    return loss, metrics


def value_loss(config, model_output, data: TensorDict, dp_group=None):
    """The critic's clipped value loss (`cliprange_value`, `loss_agg_mode`) of the predicted values
    on the responses against `returns`, clipped around the rollout's `values`; `config` is the
    critic's config. Metrics: `critic/vf_loss`, `critic/vf_clipfrac`, `critic/vpred_mean`.

    Normalised over the whole batch as the actor's loss is (upstream's averages each micro-batch on
    its own, so its gradient grows with the number of micro-batches)."""
    dp_size, batch_num_tokens, global_batch_size = _counts(data)
    vpreds = response_outputs(model_output["values"], data)
    response_mask = data["response_mask"].to(torch.bool)
    vf_loss, vf_clipfrac = compute_value_loss(
        vpreds=vpreds,
        returns=data["returns"],
        values=data["values"],
        response_mask=response_mask,
        cliprange_value=config.cliprange_value,
        loss_agg_mode=config.loss_agg_mode,
        dp_size=dp_size,
        batch_num_tokens=batch_num_tokens,
        global_batch_size=global_batch_size,
        loss_scale_factor=getattr(config, "loss_scale_factor", None),
    )
    globally_normalised = dp_size > 1 or batch_num_tokens is not None or global_batch_size is not None
    metrics = {
        # as the actor's loss terms: SUM over micro-batches and ranks is the batch's loss
        "critic/vf_loss": Metric(AggregationType.SUM, vf_loss.detach() / dp_size)
        if globally_normalised
        else vf_loss.detach().item(),
        "critic/vf_clipfrac": vf_clipfrac.detach().item(),
        "critic/vpred_mean": masked_mean(vpreds, response_mask).detach().item(),
    }
    return vf_loss, metrics
