"""`python -m verl.trainer.main_eval key=value ...`: score generated responses, per data source.

    python -m verl.trainer.main_eval data.path=~/data/arith/test_gen.parquet
    python -m verl.trainer.main_eval data.path=gen.parquet \\
        custom_reward_function.path=my_reward.py custom_reward_function.name=compute_score

Reads the parquet file `main_generation` writes (the input columns plus `responses`, a list of n
strings per row), scores every response with `compute_score(data_source, solution_str,
ground_truth, extra_info=...)` (the custom reward function when `custom_reward_function.path` is set,
else `verl.utils.reward_score.default_compute_score`, exactly as training does; a function without an
`extra_info` parameter gets the first three arguments alone, as upstream's main_eval calls it), prints
the metrics and writes them as JSON:

    {"arith": {"num_prompts": 500, "n": 4, "mean@4": 0.41, "pass@1": 0.41, "pass@2": 0.55, ...}, ...}

- `mean@n`: the mean score over every response of the data source (each prompt has n).
- `pass@k` for k = 1..n: the probability that at least one of k responses drawn without
  replacement from a prompt's n is correct, averaged over prompts, with the unbiased estimator
  `1 - C(n-c, k) / C(n, k)` for c correct out of n (Chen et al., 2021, "Evaluating Large Language
  Models Trained on Code"). pass@1 is the fraction of correct responses.

Design decisions:
- A response is correct when the scorer's result has an `acc` entry (a dict result) and it is
  true, else when its score is at least `metrics.correct_threshold` (default 1.0, the full-credit
  score of the built-in rules, so a format-only bonus such as countdown's 0.1 is not a pass).
- Every prompt of one data source must have the same n, since pass@k for k up to n is reported;
  different data sources may differ.
- Scoring runs in this process: the rule-based scorers take microseconds per response, less than
  what shipping the rows to Ray workers (upstream's choice) would cost. A scorer that raises or
  returns a non-number stops the run with the row, response and data source named.
"""

from __future__ import annotations

import json
import math
import numbers
import os
from collections.abc import Callable, Mapping, Sequence


def main(argv: list[str] | None = None) -> None:
    from verl.trainer.tool_config import load_tool_config

    run_evaluation(load_tool_config("evaluation", argv))


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one prompt with `c` correct out of `n` responses: 1 - C(n-c, k) / C(n, k).

    Exact integer binomials (a correctly rounded quotient), so large n loses no precision.
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def compute_metrics(results: Mapping[str, Sequence[Sequence[tuple[float, bool]]]]) -> dict[str, dict]:
    """`{data_source: [per prompt: [(score, correct) per response]]}` -> the metrics described above."""
    metrics = {}
    for data_source, prompts in sorted(results.items()):
        counts = sorted({len(responses) for responses in prompts})
        if len(counts) != 1 or counts[0] == 0:
            raise ValueError(
                f"data source {data_source!r}: prompts have {counts} responses; pass@k needs the same number n >= 1 "
                "of responses for every prompt (regenerate with main_generation, which writes data.n_samples per row)"
            )
        n = counts[0]
        scores = [score for responses in prompts for score, _ in responses]
        num_correct = [sum(correct for _, correct in responses) for responses in prompts]
        entry = {"num_prompts": len(prompts), "n": n, f"mean@{n}": sum(scores) / len(scores)}
        for k in range(1, n + 1):
            entry[f"pass@{k}"] = sum(pass_at_k(n, c, k) for c in num_correct) / len(prompts)
        metrics[data_source] = entry
    return metrics


def _score_fn(config) -> Callable:
    from verl.trainer.ppo.reward import get_custom_reward_fn
    from verl.utils.reward_score import default_compute_score

    return _passing_extra_info_if_taken(get_custom_reward_fn(config) or default_compute_score)


def _passing_extra_info_if_taken(fn: Callable) -> Callable:
    """`fn(data_source, response, ground_truth, extra_info)` as a call that passes `extra_info` (as a
    keyword) only to a function that takes it. Upstream's main_eval calls reward functions with the
    first three arguments alone, and recipes' functions are written for that (verl-recipe's
    open_math_reasoning `compute_score_data_source(data_source, response, ground_truth)`)."""
    import inspect

    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # no readable signature: call it as upstream does
        params = ()
    takes_extra_info = any(p.name == "extra_info" or p.kind is p.VAR_KEYWORD for p in params)
    if takes_extra_info:
        return lambda data_source, response, ground_truth, extra_info: fn(
            data_source, response, ground_truth, extra_info=extra_info
        )
    return lambda data_source, response, ground_truth, extra_info: fn(data_source, response, ground_truth)


def _read_rows(path: str, columns: list[str]) -> list[dict]:
    import pyarrow.parquet as pq

    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"data.path={path!r} does not exist (cwd: {os.getcwd()}); write it with python -m "
            "verl.trainer.main_generation first"
        )
    schema = pq.read_schema(path)
    missing = [c for c in columns[:3] if c not in schema.names]
    if missing:
        keys = {
            columns[0]: "data.response_key",
            columns[1]: "data.data_source_key",
            columns[2]: "data.reward_model_key",
        }
        raise ValueError(
            f"{path} has no column {missing[0]!r} ({keys[missing[0]]}); its columns are {schema.names}. "
            f"Set {keys[missing[0]]} to the right column"
        )
    return pq.read_table(path, columns=[c for c in columns if c in schema.names]).to_pylist()


def score_rows(rows: list[dict], config, score_fn: Callable) -> dict[str, list[list[tuple[float, bool]]]]:
    """Score every response: `{data_source: [per row: [(score, correct) per response]]}`."""
    data = config.data
    threshold = float(config.metrics.correct_threshold)
    results: dict[str, list] = {}
    for i, row in enumerate(rows):
        data_source = row[data.data_source_key]
        reward_model = row[data.reward_model_key]
        if not isinstance(reward_model, Mapping) or "ground_truth" not in reward_model:
            raise ValueError(
                f"row {i}: column {data.reward_model_key!r} must be a struct with a 'ground_truth' field, got "
                f"{str(reward_model)[:80]!r}"
            )
        responses = row[data.response_key]
        responses = [responses] if isinstance(responses, str) else list(responses or [])
        scored = []
        for j, response in enumerate(responses):
            try:
                result = score_fn(data_source, response, reward_model["ground_truth"], row.get("extra_info"))
            except Exception as e:
                raise RuntimeError(
                    f"scoring row {i}, response {j} (data_source={data_source!r}) raised {type(e).__name__}: {e}"
                ) from e
            score = result.get("score") if isinstance(result, Mapping) else result
            if not isinstance(score, numbers.Real) or not math.isfinite(score):
                raise ValueError(
                    f"row {i}, response {j} (data_source={data_source!r}): the reward function returned "
                    f"{result!r}; it must return a finite number or a dict with a numeric 'score'"
                )
            if isinstance(result, Mapping) and "acc" in result:
                correct = bool(result["acc"])
            else:
                correct = score >= threshold
            scored.append((float(score), correct))
        results.setdefault(str(data_source), []).append(scored)
    return results


def format_metrics(metrics: dict[str, dict]) -> str:
    lines = []
    for data_source, entry in metrics.items():
        values = " ".join(f"{k}={v:.4f}" for k, v in entry.items() if k.startswith(("mean@", "pass@")))
        lines.append(f"{data_source} ({entry['num_prompts']} prompts x {entry['n']}): {values}")
    return "\n".join(lines)


def run_evaluation(config) -> dict[str, dict]:
    """Score `data.path`, print the metrics, write them to the JSON output path, and return them."""
    data = config.data
    path = os.path.expanduser(data.path)
    rows = _read_rows(path, [data.response_key, data.data_source_key, data.reward_model_key, "extra_info"])
    metrics = compute_metrics(score_rows(rows, config, _score_fn(config)))
    output_path = os.path.expanduser(data.output_path) if data.output_path else _default_output(path)
    os.makedirs(os.path.dirname(os.path.abspath(output_path)), exist_ok=True)
    with open(output_path, "w") as f:
        json.dump(metrics, f, indent=2)
    print(format_metrics(metrics))
    print(f"wrote {output_path}")
    return metrics


def _default_output(path: str) -> str:
    stem = path[: -len(".parquet")] if path.endswith(".parquet") else path
    return stem + ".eval.json"


if __name__ == "__main__":
    main()
