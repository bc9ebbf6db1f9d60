"""Metrics the driver reports each step, under upstream verl's names.

Pure functions of a DataProto batch and the step's phase timings, so the driver's `step()` stays a
list of phases and these stay testable on hand-built batches.

- `compute_data_metrics`: critic/score|rewards|advantages|returns|values/*, response_length/*,
  prompt_length/* (with clip ratios), num_turns/* (multi-turn rollouts).
- `compute_timing_metrics`: timing_s/<phase> and timing_per_token_ms/<phase>.
- `compute_throughput_metrics`: perf/total_num_tokens, perf/time_per_step, perf/throughput.
- `process_validation_metrics`: mean@N, best@N, worst@N, maj@N per data source and variable.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

import numpy as np
import torch


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
    metrics: dict[str, float] = {}

    for name, key in (("score", "token_level_scores"), ("rewards", "token_level_rewards")):
        if key in batch.batch:
            seq = batch.batch[key].sum(-1).float()
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
    if "__num_turns__" in batch.non_tensor_batch:  # multi-turn rollouts: messages per conversation
        num_turns = np.asarray(batch.non_tensor_batch["__num_turns__"], dtype=np.float64)
        metrics["num_turns/min"] = float(num_turns.min())
        metrics["num_turns/max"] = float(num_turns.max())
        metrics["num_turns/mean"] = float(num_turns.mean())
    return metrics


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


def process_validation_metrics(
    data_sources: np.ndarray, uids: np.ndarray, infos: dict[str, list[Any]]
) -> dict[str, dict[str, dict[str, float]]]:
    """Aggregate per-sample validation values into {data_source: {variable: {metric: value}}}.

    For each prompt (uid) with N samples of a numeric variable: mean@N (mean over samples),
    std@N, and when N > 1 best@N/mean and worst@N/mean (max/min over the N samples, averaged over
    prompts). When `infos` has a `pred` list, maj@N/mean scores the majority prediction of each
    group (ties go to the first prediction seen). Values are averaged over prompts per data source.
    """
    groups: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    for i, (source, uid) in enumerate(zip(data_sources, uids)):
        groups[source][uid].append(i)
    preds = infos.get("pred")
    result: dict[str, dict[str, dict[str, float]]] = {}
    for source, by_uid in groups.items():
        per_var: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        for idxs in by_uid.values():
            n = len(idxs)
            for var, values in infos.items():
                if var == "pred":
                    continue
                vals = [values[i] for i in idxs]
                if not all(isinstance(v, (int, float, np.number, bool, np.bool_)) for v in vals):
                    continue
                arr = np.asarray(vals, dtype=np.float64)
                per_var[var][f"mean@{n}"].append(arr.mean())
                per_var[var][f"std@{n}"].append(arr.std())
                if n > 1:
                    per_var[var][f"best@{n}/mean"].append(arr.max())
                    per_var[var][f"worst@{n}/mean"].append(arr.min())
                    if preds is not None:
                        group_preds = [preds[i] for i in idxs]
                        majority = Counter(group_preds).most_common(1)[0][0]
                        at = group_preds.index(majority)
                        per_var[var][f"maj@{n}/mean"].append(arr[at])
        result[source] = {var: {m: float(np.mean(v)) for m, v in ms.items()} for var, ms in per_var.items()}
    return result


def flatten_validation_metrics(
    nested: dict[str, dict[str, dict[str, float]]], core_var: str = "acc"
) -> dict[str, float]:
    """val-core/<source>/<var>/<metric> for the core variable's headline metrics, val-aux/... otherwise.

    The core variable is `acc` when present, else `reward`. Headline metrics are mean@N, maj@N/mean
    and best@N/mean at the largest N.
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
