"""Metrics the driver reports each step, under upstream verl's names.

Pure functions of a DataProto batch and the step's phase timings, so the driver's `step()` stays a
list of phases and these stay testable on hand-built batches.

- `compute_data_metrics`: critic/score|rewards|advantages|returns|values/*, response_length/*,
  prompt_length/* (with clip ratios), num_turns/* (multi-turn rollouts). As upstream, a row with an
  empty response is an aborted one (cut by `rollout.over_sample_rate`): score and reward statistics
  leave such rows out, `response/aborted_ratio` is their share and `response_length_non_aborted/*`
  the length statistics without them.
- `compute_variance_proxy_metrics`: variance_proxy/* (upstream's gradient-variance proxies from the
  actor's `sum_pi_squared`), for a trainer that logs them; the driver does not call it.
- `compute_timing_metrics`: timing_s/<phase> and timing_per_token_ms/<phase>.
- `compute_throughput_metrics`: perf/total_num_tokens, perf/time_per_step, perf/throughput
  (`compute_throughout_metrics` is upstream's spelling).
- `process_validation_metrics`: per data source and variable, mean@N and std@N of each prompt's N
  samples, and bootstrap estimates (`bootstrap_metric`, seeded) of best@n, worst@n and maj@n for
  n = 2, 4, 8, ... < N and n = N: the mean and std over 1000 resamples of n of the N samples of the
  expected best / worst / majority-vote value, as upstream computes them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import torch

import verl.utils.torch_functional as verl_F


def _masked_stats(values: torch.Tensor, mask: torch.Tensor) -> tuple[float, float, float]:
    valid = values[mask.bool()]
    if valid.numel() == 0:
        return 0.0, 0.0, 0.0
    valid = valid.float()
    return valid.mean().item(), valid.max().item(), valid.min().item()


def _lengths(batch) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    response_length = batch.batch["responses"].shape[-1]
    attention_mask = batch.batch["attention_mask"]
    prompt_mask = attention_mask[:, :-response_length]
    response_mask = (
        batch.batch["response_mask"] if "response_mask" in batch.batch else attention_mask[:, -response_length:]
    )
    return prompt_mask.sum(-1).float(), response_mask.sum(-1).float(), prompt_mask.shape[-1], response_length


def compute_data_metrics(batch, use_critic: bool = True) -> dict[str, float]:
    """Score/reward/advantage/return/value statistics and length statistics of one training batch.

    Sequence score = sum over response tokens of `token_level_scores` (reward before KL);
    sequence reward = sum of `token_level_rewards`; advantages, returns and values are averaged over
    valid response tokens only.
    """
    response_mask = batch.batch["response_mask"].bool()
    prompt_length, response_length, max_prompt_length, max_response_length = _lengths(batch)
    aborted = response_length == 0  # cut by over-sampling: no response (module docstring)
    # over-sampling always finishes some episodes; a batch of nothing but empty responses is some other
    # rollout's doing, whose scores are still worth seeing
    kept = ~aborted if not aborted.all() else torch.ones_like(aborted)
    metrics: dict[str, float] = {}

    for name, key in (("score", "token_level_scores"), ("rewards", "token_level_rewards")):
        if key in batch.batch:
            seq = batch.batch[key].sum(-1).float()[kept]
            metrics[f"critic/{name}/mean"] = seq.mean().item()
            metrics[f"critic/{name}/max"] = seq.max().item()
            metrics[f"critic/{name}/min"] = seq.min().item()
    for name in ("advantages", "returns") + (("values",) if use_critic else ()):
        if name in batch.batch:
            mean, mx, mn = _masked_stats(batch.batch[name], response_mask)
            metrics[f"critic/{name}/mean"], metrics[f"critic/{name}/max"], metrics[f"critic/{name}/min"] = mean, mx, mn
    if use_critic and "values" in batch.batch and "returns" in batch.batch:
        returns = batch.batch["returns"][response_mask].float()
        values = batch.batch["values"][response_mask].float()
        var_returns = torch.var(returns, unbiased=False)
        explained = 1.0 - torch.var(returns - values, unbiased=False) / (var_returns + 1e-5)
        metrics["critic/vf_explained_var"] = explained.item()

    for name, lengths, max_len in (
        ("response_length", response_length, max_response_length),
        ("prompt_length", prompt_length, max_prompt_length),
    ):
        metrics[f"{name}/mean"] = lengths.mean().item()
        metrics[f"{name}/max"] = lengths.max().item()
        metrics[f"{name}/min"] = lengths.min().item()
        metrics[f"{name}/clip_ratio"] = (lengths >= max_len).float().mean().item()
    metrics["response/aborted_ratio"] = aborted.float().mean().item()
    kept_lengths = response_length[~aborted]
    if kept_lengths.numel() == 0:
        kept_lengths = torch.zeros(1)
    metrics["response_length_non_aborted/mean"] = kept_lengths.mean().item()
    metrics["response_length_non_aborted/max"] = kept_lengths.max().item()
    metrics["response_length_non_aborted/min"] = kept_lengths.min().item()
    metrics["response_length_non_aborted/clip_ratio"] = (kept_lengths >= max_response_length).float().mean().item()
    if "__num_turns__" in batch.non_tensor_batch:  # multi-turn rollouts: messages per conversation
        num_turns = np.asarray(batch.non_tensor_batch["__num_turns__"], dtype=np.float64)
        metrics["num_turns/min"] = float(num_turns.min())
        metrics["num_turns/max"] = float(num_turns.max())
        metrics["num_turns/mean"] = float(num_turns.mean())
    return metrics


def _compute_response_info(batch) -> dict[str, torch.Tensor]:
    """Upstream's helper: `response_mask` (the response part of `attention_mask`, [B, R]) and the
    float `prompt_length` / `response_length` [B] of each row."""
    response_length = batch.batch["responses"].shape[-1]
    attention_mask = batch.batch["attention_mask"]
    response_mask = attention_mask[:, -response_length:]
    return {
        "response_mask": response_mask,
        "prompt_length": attention_mask[:, :-response_length].sum(-1).float(),
        "response_length": response_mask.sum(-1).float(),
    }


def compute_variance_proxy_metrics(batch, gradient_norm: float | None = None) -> dict[str, float]:
    r"""Cheap proxies of the policy gradient's variance, upstream's `variance_proxy/*` metrics.

    Needs `sum_pi_squared` ($\sum_v \pi_v^2$ per token), `old_log_probs`, `advantages` and
    `response_mask` in the batch; returns {} when one of the first three is missing. With
    $W(\tau) = \sum_t [1 - 2\pi_t(y_t) + \sum_v \pi_{t,v}^2]$ (the squared norm of the score
    w.r.t. the logits, summed over the response) and $A$ the sequence's mean advantage:

    - proxy1_signal_strength: $\|\bar g\|^2$ = `gradient_norm`**2 (0 when not given);
    - proxy2_total_power: $E[A^2 \max(W, 0)]$, or with `rollout_is_weights` $\rho$ in the batch
      $E[\bar\rho^2 A^2 \max(W, 0)]$ ($\bar\rho$ the sequence's mean weight);
    - proxy3_pure_noise: $\max(0, (\text{proxy2} - \text{proxy1}) / (N - 1))$ for N > 1 sequences
      and a given gradient norm, else 0;
    - expected_a_squared $E[A^2]$, expected_w $E[W]$ (each token's term scaled by $\rho_t^2$ when
      IS weights are present).
    """
    data = batch.batch
    if any(key not in data for key in ("sum_pi_squared", "old_log_probs", "advantages")):
        return {}
    mask = data["response_mask"]
    w_tokens = 1 - 2 * torch.exp(data["old_log_probs"]) + data["sum_pi_squared"]
    weights = data["rollout_is_weights"].detach() if "rollout_is_weights" in data else None
    if weights is not None:
        w_tokens = w_tokens * weights**2
    advantage = verl_F.masked_mean(data["advantages"], mask, axis=-1)
    w_values = verl_F.masked_sum(w_tokens, mask, axis=-1)
    if weights is None:
        total_power = (advantage**2 * w_values.clamp(min=0.0)).mean()
    else:
        mean_weight = verl_F.masked_mean(weights, mask, axis=-1)
        w_unweighted = verl_F.masked_sum(w_tokens / (weights**2).clamp(min=1e-10), mask, axis=-1)
        total_power = (mean_weight**2 * advantage**2 * w_unweighted.clamp(min=0.0)).mean()
    signal = gradient_norm**2 if gradient_norm is not None else None
    num_sequences = advantage.shape[0]
    noise = 0.0
    if signal is not None and num_sequences > 1:
        noise = max(0.0, (total_power.item() - signal) / (num_sequences - 1))
    return {
        "variance_proxy/proxy1_signal_strength": signal if signal is not None else 0.0,
        "variance_proxy/proxy2_total_power": total_power.item(),
        "variance_proxy/proxy3_pure_noise": noise,
        "variance_proxy/expected_a_squared": (advantage**2).mean().item(),
        "variance_proxy/expected_w": w_values.mean().item(),
    }


# Phases whose cost scales with response tokens only; every other timed phase scales with all tokens.
_RESPONSE_ONLY_PHASES = ("gen",)


def compute_timing_metrics(batch, timing_raw: dict[str, float]) -> dict[str, float]:
    """timing_s/<phase> for every timed phase and timing_per_token_ms/<phase> where tokens are known."""
    prompt_length, response_length, _, _ = _lengths(batch)
    num_response_tokens = response_length.sum().item()
    num_all_tokens = num_response_tokens + prompt_length.sum().item()
    metrics = {f"timing_s/{name}": value for name, value in timing_raw.items()}
    for name, value in timing_raw.items():
        if name == "step":
            continue
        tokens = num_response_tokens if name in _RESPONSE_ONLY_PHASES else num_all_tokens
        if tokens > 0:
            metrics[f"timing_per_token_ms/{name}"] = value * 1000.0 / tokens
    return metrics


def compute_throughput_metrics(batch, timing_raw: dict[str, float], n_gpus: int) -> dict[str, float]:
    """perf/total_num_tokens, perf/time_per_step and perf/throughput (tokens per second per device)."""
    total_num_tokens = int(batch.batch["attention_mask"].sum().item())
    time_per_step = timing_raw["step"]
    return {
        "perf/total_num_tokens": total_num_tokens,
        "perf/time_per_step": time_per_step,
        "perf/throughput": total_num_tokens / (time_per_step * max(n_gpus, 1)),
    }


def compute_throughout_metrics(batch, timing_raw: dict[str, float], n_gpus: int) -> dict[str, float]:
    """Upstream's name for the throughput metrics: `perf/total_num_tokens` is the sum of
    `meta_info["global_token_num"]` when the batch has it (the trainer sets it), else of the attention mask."""
    if "global_token_num" in batch.meta_info:
        total = int(sum(batch.meta_info["global_token_num"]))
        time_per_step = timing_raw["step"]
        return {
            "perf/total_num_tokens": total,
            "perf/time_per_step": time_per_step,
            "perf/throughput": total / (time_per_step * max(n_gpus, 1)),
        }
    return compute_throughput_metrics(batch, timing_raw, n_gpus)


_VECTOR_REDUCERS = {np.max: np.max, np.min: np.min, np.mean: np.mean}
_BOOTSTRAP_SAMPLES = 1000


def bootstrap_metric(
    data: list[Any],
    subset_size: int,
    reduce_fns: list[Callable[[np.ndarray], float]],
    n_bootstrap: int = 1000,
    seed: int = 42,
) -> list[tuple[float, float]]:
    """(mean, std) over `n_bootstrap` resamples of `subset_size` items of `data` (with replacement) of
    each `reduce_fns` value: e.g. `[np.max]` estimates the expected best of `subset_size` samples.

    The resamples are drawn as upstream draws them (`RandomState(seed).choice(len(data),
    (n_bootstrap, subset_size))`), so equal seeds give upstream's numbers; the global numpy
    generator is left alone.
    """
    values = np.empty(len(data), dtype=object)
    values[:] = list(data)
    idxs = np.random.RandomState(seed).choice(len(values), size=(n_bootstrap, subset_size), replace=True)
    results = []
    numeric = all(isinstance(v, (int, float, np.number, bool, np.bool_)) for v in data)
    for fn in reduce_fns:
        if numeric and fn in _VECTOR_REDUCERS:
            per_sample = _VECTOR_REDUCERS[fn](np.asarray(data, dtype=np.float64)[idxs], axis=1)
        else:
            per_sample = np.array([fn(values[row]) for row in idxs], dtype=np.float64)
        results.append((float(np.mean(per_sample)), float(np.std(per_sample))))
    return results


def calc_maj_val(data: list[dict[str, Any]], vote_key: str, val_key: str) -> float:
    """The `val_key` of the first item whose `vote_key` is the most common one (ties: the vote seen first)."""
    by_vote: dict[Any, list] = {}
    for item in data:
        by_vote.setdefault(item[vote_key], []).append(item[val_key])
    winner = max(by_vote, key=lambda vote: len(by_vote[vote]))
    return by_vote[winner][0]


def _subset_sizes(num_samples: int) -> list[int]:
    """2, 4, 8, ... below `num_samples`, then `num_samples` itself (none for a single sample)."""
    if num_samples <= 1:
        return []
    sizes, n = [], 2
    while n < num_samples:
        sizes.append(n)
        n *= 2
    return sizes + [num_samples]


def _is_number(value) -> bool:
    return isinstance(value, (int, float, np.number, bool, np.bool_)) and not isinstance(value, str)


def process_validation_metrics(
    data_sources, sample_uids, infos_dict: dict[str, list[Any]], seed: int = 42
) -> dict[str, dict[str, dict[str, float]]]:
    """Aggregate per-sample validation values into {data_source: {variable: {metric: value}}}.

    Per prompt (uid) with N samples of a numeric variable: `mean@N`; when N > 1 also `std@N` and,
    for each n of 2, 4, 8, ... < N and N, `best@n/mean|std` and `worst@n/mean|std` (bootstrap over
    resamples of n of the N values, see `bootstrap_metric`, with `seed`) and, when `infos_dict` has
    a `pred` list, `maj@n/mean|std` (the value of the majority prediction, `calc_maj_val`). Each
    metric is then averaged over the prompts of a data source. Variables with non-numeric values
    (`pred` itself, strings, missing entries) are skipped.
    """
    grouped: dict[Any, dict[Any, list[int]]] = defaultdict(lambda: defaultdict(list))
    for i, (source, uid) in enumerate(zip(data_sources, sample_uids)):
        grouped[source][uid].append(i)
    preds = infos_dict.get("pred")
    maj_fn = partial(calc_maj_val, vote_key="pred", val_key="val")
    result: dict[str, dict[str, dict[str, float]]] = {}
    for source, by_uid in grouped.items():
        per_var: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        for idxs in by_uid.values():
            n = len(idxs)
            for var, values in infos_dict.items():
                vals = [values[i] for i in idxs]
                if var == "pred" or not all(_is_number(v) for v in vals):
                    continue
                per_var[var][f"mean@{n}"].append(float(np.mean(vals)))
                if n == 1:
                    continue
                per_var[var][f"std@{n}"].append(float(np.std(vals)))
                votes = None if preds is None else [{"val": v, "pred": preds[i]} for v, i in zip(vals, idxs)]
                for size in _subset_sizes(n):
                    (best, best_std), (worst, worst_std) = bootstrap_metric(
                        vals, size, [np.max, np.min], n_bootstrap=_BOOTSTRAP_SAMPLES, seed=seed
                    )
                    per_var[var][f"best@{size}/mean"].append(best)
                    per_var[var][f"best@{size}/std"].append(best_std)
                    per_var[var][f"worst@{size}/mean"].append(worst)
                    per_var[var][f"worst@{size}/std"].append(worst_std)
                    if votes is not None:
                        [(maj, maj_std)] = bootstrap_metric(
                            votes, size, [maj_fn], n_bootstrap=_BOOTSTRAP_SAMPLES, seed=seed
                        )
                        per_var[var][f"maj@{size}/mean"].append(maj)
                        per_var[var][f"maj@{size}/std"].append(maj_std)
        result[source] = {var: {m: float(np.mean(v)) for m, v in ms.items()} for var, ms in per_var.items()}
    return result


def flatten_validation_metrics(
    nested: dict[str, dict[str, dict[str, float]]], core_var: str = "acc"
) -> dict[str, float]:
    """val-core/<source>/<var>/<metric> for the core variable's headline metrics, val-aux/... otherwise.

    The core variable is `acc` when present, else `reward`. Headline metrics are the mean@, maj@ and
    best@ metrics at the largest N (their /mean and /std both, as upstream).
    """
    flat: dict[str, float] = {}
    for source, by_var in nested.items():
        core = core_var if core_var in by_var else "reward"
        for var, metrics in by_var.items():
            n_max = max(int(m.split("@")[1].split("/")[0]) for m in metrics)
            for metric, value in metrics.items():
                n = int(metric.split("@")[1].split("/")[0])
                headline = n == n_max and (metric.startswith("mean@") or metric.startswith(("maj@", "best@")))
                prefix = "val-core" if var == core and headline else "val-aux"
                flat[f"{prefix}/{source}/{var}/{metric}"] = value
    return flat


def reduce_metrics(metrics: dict[str, list[float] | float]) -> dict[str, float]:
    """Mean of each metric's list of per-micro-batch (or per-rank) values."""
    out = {}
    for key, value in metrics.items():
        if isinstance(value, (list, tuple, np.ndarray)):
            out[key] = float(np.mean(value)) if len(value) else 0.0
        elif isinstance(value, torch.Tensor):
            out[key] = value.float().mean().item()
        else:
            out[key] = float(value)
    return out
