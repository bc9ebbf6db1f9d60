"""Reward of the synthetic colour-naming task (``verl.utils.dataset.vl_colors``, data_source
``vl_colors``): 1.0 when the response, stripped of surrounding whitespace and a final period and
lower-cased, is exactly the colour's name, else 0.0. Exact match keeps the task unambiguous: a model
that answers "red, maybe blue" has not answered."""

from __future__ import annotations


def compute_score(solution_str: str, ground_truth: str) -> float:
    answer = solution_str.strip().rstrip(".").strip().lower()
    return 1.0 if answer == str(ground_truth).strip().lower() else 0.0
