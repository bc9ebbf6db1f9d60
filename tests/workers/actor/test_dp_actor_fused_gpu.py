"""The fused log-prob path on one CUDA device with bf16 compute (FSDP2 mixed precision, fp32 master
weights) against an fp32 CPU reference: log-probs, entropy and the update are as close to it as the
unfused bf16 path's are. Skipped without a GPU."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.distributed_helpers import device_preference, make_tiny_causal_lm
from tests.workers.actor.test_dp_actor import TEMPERATURE, actor_config, param_delta, training_batch

pytestmark = pytest.mark.gpu


def _run(data, fused: bool, device: str, use_remove_padding: bool):
    from verl.utils import fsdp_utils
    from verl.workers.actor import DataParallelPPOActor

    model = make_tiny_causal_lm(dtype=torch.float32)
    reference_weights = copy.deepcopy(model)
    if device == "cuda":
        model = fsdp_utils.apply_fsdp2(model)  # bf16 compute, fp32 reduce, fp32 master weights
    config = actor_config(
        use_remove_padding=use_remove_padding,
        use_fused_kernels=fused,
        entropy_coeff=0.01,
        calculate_entropy=True,
        share_prompt_forward=False,
    )
    actor = DataParallelPPOActor(config, model, torch.optim.SGD(model.parameters(), lr=1.0))
    scored = copy.deepcopy(data)
    scored.meta_info.update(micro_batch_size=4)
    log_probs, entropy = actor.compute_log_prob(scored, calculate_entropy=True)
    actor.update_policy(data)
    if device == "cuda":
        weights = {name: t.float().cpu() for name, t in fsdp_utils.iter_full_params(model)}
    else:
        weights = {name: t.detach() for name, t in model.named_parameters()}
    after = copy.deepcopy(reference_weights)
    after.load_state_dict(weights, strict=False)
    return log_probs.float().cpu(), entropy.float().cpu(), param_delta(reference_weights, after)


@pytest.mark.parametrize("use_remove_padding", [False, True])
def test_bf16_fused_path_is_as_close_to_the_fp32_reference_as_the_unfused_one(nccl_group, use_remove_padding):
    data = training_batch(seed=5)
    for key in ("old_log_probs", "advantages"):
        data.batch[key] = data.batch[key].float()
    mask = data.batch["response_mask"].bool()
    with device_preference("cpu"):
        ref_lp, ref_ent, ref_delta = _run(data, False, "cpu", use_remove_padding)
    results = {fused: _run(data, fused, "cuda", use_remove_padding) for fused in (False, True)}

    def errors(result):
        lp, ent, delta = result
        delta_err = max(float((delta[n] - ref_delta[n]).abs().max() / ref_delta[n].abs().max()) for n in ref_delta)
        return float((lp - ref_lp)[mask].abs().max()), float((ent - ref_ent)[mask].abs().max()), delta_err

    unfused, fused = errors(results[False]), errors(results[True])
    # bf16 rounding bounds both paths; the fused one computes the softmax in fp32 from bf16 logits, as the unfused
    for name, f, u in zip(("log_probs", "entropy", "update"), fused, unfused, strict=True):
        assert f <= 2 * u + 2e-2, (
            f"{name}: fused error {f:.3g} vs unfused {u:.3g} against fp32 (TEMPERATURE={TEMPERATURE})"
        )
