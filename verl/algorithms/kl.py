"""KL between the policy and the reference: per-token estimators, the in-reward penalty, the KL
loss and the KL-coefficient controllers (`algorithm.kl_penalty`, `algorithm.kl_ctrl`,
`actor.kl_loss_type`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from verl.algorithms._common import _check_shapes, _unknown_name_error
from verl.algorithms.aggregation import agg_loss
from verl.utils.torch_functional import masked_mean


def _kl_k1(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    return logprob - ref_logprob


def _kl_abs(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    return (logprob - ref_logprob).abs()


def _kl_k2(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logprob - ref_logprob).square()


def _kl_k3(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    # Clamps as upstream: the log-ratio to ±20 before exp, the estimate to ±10.
    log_ratio = torch.clamp(ref_logprob - logprob, -20.0, 20.0)
    return torch.clamp(torch.exp(log_ratio) - log_ratio - 1, -10.0, 10.0)


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "kl": _kl_k1,
    "k1": _kl_k1,
    "abs": _kl_abs,
    "mse": _kl_k2,
    "k2": _kl_k2,
    "low_var_kl": _kl_k3,
    "k3": _kl_k3,
}
"""Per-token KL estimators (Schulman, "Approximating KL divergence", 2020); any name may end in `+`."""


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    r"""Per-token estimate of KL(pi || pi_ref) from sampled-token log-probs [B, R] -> [B, R].

    With $x = \log\pi - \log\pi_{ref}$ (http://joschu.net/blog/kl-approx.html):
    `kl`/`k1`: $x$; `abs`: $|x|$; `mse`/`k2`: $x^2/2$; `low_var_kl`/`k3`:
    $e^{-x} + x - 1$ (unbiased, non-negative, low variance; clamped to [-10, 10]).
    A trailing `+` (e.g. `k3+`) is the straight-through variant: the value of the named estimator
    with the gradient of `k2`, $\nabla = x\nabla\log\pi$, whose expectation is the true KL
    gradient (the k1 and k3 gradients are biased). Used for `algorithm.kl_penalty` (in-reward)
    and `actor.kl_loss_type` (KL loss).
    """
    return _kl_estimate(logprob, ref_logprob, kl_penalty)


def kl_penalty_forward(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """The named estimator with its own gradient (upstream's name): `kl_penalty` without the
    straight-through swap, so `k3+` gives k3's value and k3's gradient. Shapes [B, R] -> [B, R]."""
    return _kl_estimate(logprob, ref_logprob, kl_penalty.removesuffix("+"))


def _kl_estimate(logprob: torch.Tensor, ref_logprob: torch.Tensor, name: str) -> torch.Tensor:
    base = name[:-1] if name.endswith("+") else name
    if base not in KL_ESTIMATORS:
        valid = [*KL_ESTIMATORS, *(f"{k}+" for k in KL_ESTIMATORS)]
        raise _unknown_name_error("KL estimator (algorithm.kl_penalty / actor.kl_loss_type)", name, valid)
    value = KL_ESTIMATORS[base](logprob, ref_logprob)
    if base == name or KL_ESTIMATORS[base] is _kl_k2:
        return value
    grad_carrier = _kl_k2(logprob, ref_logprob)
    return grad_carrier - grad_carrier.detach() + value.detach()


def compute_kl_loss(
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_loss_type: str = "low_var_kl",
    loss_agg_mode: str = "token-mean",
) -> torch.Tensor:
    r"""The KL loss term $\mathrm{agg}(\mathrm{KL}_{est}(\pi, \pi_{ref}))$ -> scalar (GRPO's in-loss KL).

    The actor adds `actor.kl_loss_coef` times this to the policy loss when `actor.use_kl_loss`.
    `kl_loss_type` is any `kl_penalty` name (default `low_var_kl`, as upstream).
    """
    _check_shapes(log_prob=log_prob, ref_log_prob=ref_log_prob, response_mask=response_mask)
    return agg_loss(kl_penalty(log_prob, ref_log_prob, kl_loss_type), response_mask, loss_agg_mode)


@torch.no_grad()
def apply_kl_penalty_tensors(
    token_level_scores: torch.Tensor,
    old_log_probs: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    kl_penalty: str = "kl",
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""KL penalty in the reward (`algorithm.use_kl_in_reward`, Ziegler et al., arXiv:1909.08593).

    $r_t = \mathrm{score}_t - \beta\,\mathrm{KL}_{est,t}$ on valid tokens, with $\beta$ = the KL
    controller's current value and the estimator `algorithm.kl_penalty`. Also returns the batch's
    current KL, the mean over responses of each response's mean token KL, which the trainer feeds
    to the controller's `update` (and logs as `actor/reward_kl_penalty`).

    Shapes: all [B, R] -> (token_level_rewards [B, R], current_kl scalar tensor).
    """
    _check_shapes(
        token_level_scores=token_level_scores,
        old_log_probs=old_log_probs,
        ref_log_prob=ref_log_prob,
        response_mask=response_mask,
    )
    kld = torch.where(response_mask != 0, _kl_estimate(old_log_probs, ref_log_prob, kl_penalty), 0.0)
    token_level_rewards = token_level_scores - kl_coef * kld
    current_kl = masked_mean(kld, response_mask, axis=-1).mean()
    return token_level_rewards, current_kl


def compute_rewards(
    token_level_scores: torch.Tensor, old_log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kl_ratio: float
) -> torch.Tensor:
    r"""Upstream's plain in-reward KL: $r_t = \mathrm{score}_t - \beta(\log\pi_{old} - \log\pi_{ref})$
    with $\beta$ = `kl_ratio`, on every position (no mask, no estimator choice; the trainer uses
    `apply_kl_penalty_tensors`, which masks padding and takes `algorithm.kl_penalty`). Shapes [B, R]."""
    _check_shapes(token_level_scores=token_level_scores, old_log_prob=old_log_prob, ref_log_prob=ref_log_prob)
    return token_level_scores - kl_ratio * (old_log_prob - ref_log_prob)


class FixedKLController:
    """A constant KL coefficient (`algorithm.kl_ctrl.type=fixed`)."""

    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient stays fixed."""


class AdaptiveKLController:
    r"""Adaptive KL coefficient (Ziegler et al., arXiv:1909.08593; `algorithm.kl_ctrl.type=adaptive`).

    After each batch: $e = \mathrm{clip}(\mathrm{KL}/\mathrm{KL}_{target} - 1, -0.2, 0.2)$,
    $\beta \leftarrow \beta\,(1 + e\cdot n_{steps}/\mathrm{horizon})$, so $\beta$ grows while the
    measured KL is above `target_kl` and shrinks below it.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if horizon <= 0:
            raise ValueError(f"algorithm.kl_ctrl.horizon={horizon} must be > 0 for the adaptive KL controller")
        if target_kl <= 0:
            raise ValueError(f"algorithm.kl_ctrl.target_kl={target_kl} must be > 0 for the adaptive KL controller")
        self.value = init_kl_coef
        self.target = target_kl
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """Adapt the coefficient to the KL measured over `n_steps` samples (a float or 0-d tensor)."""
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


KL_CONTROLLERS = ("fixed", "adaptive")


def get_kl_controller(
    kl_ctrl_type, kl_coef: float | None = None, target_kl: float | None = None, horizon: int | None = None
) -> FixedKLController | AdaptiveKLController:
    """Build the controller named by `algorithm.kl_ctrl.type` from `kl_ctrl.{kl_coef,target_kl,horizon}`.

    Also takes the `algorithm.kl_ctrl` section itself (`get_kl_controller(config.algorithm.kl_ctrl)`,
    upstream's call)."""
    if not isinstance(kl_ctrl_type, str):
        section = kl_ctrl_type
        kl_ctrl_type, kl_coef = section.type, section.kl_coef
        target_kl, horizon = getattr(section, "target_kl", None), getattr(section, "horizon", None)
    if kl_ctrl_type == "fixed":
        return FixedKLController(kl_coef)
    if kl_ctrl_type == "adaptive":
        if target_kl is None or horizon is None:
            raise ValueError(
                "algorithm.kl_ctrl.type=adaptive needs kl_ctrl.target_kl and kl_ctrl.horizon "
                f"(got target_kl={target_kl}, horizon={horizon}); upstream defaults are 0.1 and 10000"
            )
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise _unknown_name_error("algorithm.kl_ctrl.type", kl_ctrl_type, KL_CONTROLLERS)
