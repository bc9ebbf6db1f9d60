"""Training curves of a run as one PNG: training reward, validation accuracy, response length vs step.

Design decisions:
- Reads the file tracker's JSONL (`{"step": N, "data": {...}}` per line; flat `{"step": N, key:
  value}` lines are accepted too), so any finished or running run can be plotted afterwards:
  `python -m verl.utils.plotting outputs/<project>/<experiment>/metrics.jsonl out.png`.
- Draws on a bare `matplotlib.figure.Figure` with the Agg canvas instead of pyplot, so it never
  switches the process's global backend and never needs a display.
- The metrics are upstream's names: `critic/score/mean` (mean sequence score of the step's
  rollouts), `val-core/<data_source>/acc/mean@<n>` (one line per data source and n), and
  `response_length/mean`. A metric that was never logged leaves its panel empty with a note.
- When a resumed run logs a step again, the later value wins.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

REWARD_KEY = "critic/score/mean"
RESPONSE_LENGTH_KEY = "response_length/mean"
VAL_ACC_PATTERN = re.compile(r"^val-core/(?P<source>.+)/acc/mean@(?P<n>\d+)$")


def is_plotted_metric(key: str) -> bool:
    """Whether `key` appears in the training-curves figure."""
    return key in (REWARD_KEY, RESPONSE_LENGTH_KEY) or VAL_ACC_PATTERN.match(key) is not None


def read_metrics_jsonl(path: str | Path) -> list[dict]:
    """Records `{"step": int, "data": {...}}` from a metrics JSONL file (blank lines skipped)."""
    records = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno} is not valid JSON ({e}); each line must be one JSON object") from e
            if "step" not in obj:
                raise ValueError(f"{path}:{lineno} has no 'step' field; expected {{'step': N, 'data': {{...}}}}")
            data = obj["data"] if isinstance(obj.get("data"), dict) else {k: v for k, v in obj.items() if k != "step"}
            records.append({"step": obj["step"], "data": data})
    return records


def _series(records: list[dict], key: str) -> tuple[list, list]:
    by_step = {}
    for r in records:
        v = r["data"].get(key)
        if isinstance(v, int | float) and not isinstance(v, bool):
            by_step[r["step"]] = float(v)
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def plot_curves_from_records(records: list[dict], out_png: str | Path) -> Path:
    """Draw the three panels from metric records and write `out_png`; returns its path."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 3.6), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax_reward, ax_val, ax_len = fig.subplots(1, 3)

    def draw(ax, key, title, ylabel, color):
        steps, values = _series(records, key)
        if steps:
            ax.plot(steps, values, color=color, marker="." if len(steps) < 40 else None, linewidth=1.5)
        else:
            ax.text(0.5, 0.5, f"{key}\nnot logged", ha="center", va="center", transform=ax.transAxes, color="gray")
        ax.set_title(title)
        ax.set_ylabel(ylabel)

    draw(ax_reward, REWARD_KEY, "Training reward", "mean score per response", "tab:blue")
    draw(ax_len, RESPONSE_LENGTH_KEY, "Response length", "mean tokens", "tab:green")

    val_keys = sorted({k for r in records for k in r["data"] if VAL_ACC_PATTERN.match(k)})
    for key in val_keys:
        steps, values = _series(records, key)
        m = VAL_ACC_PATTERN.match(key)
        ax_val.plot(steps, values, marker="o", markersize=3, linewidth=1.5, label=f"{m['source']} (mean@{m['n']})")
    if val_keys:
        ax_val.set_ylim(-0.02, 1.02)
        ax_val.legend(loc="lower right", fontsize=8)
    else:
        ax_val.text(
            0.5,
            0.5,
            "val-core/*/acc/mean@*\nnot logged",
            ha="center",
            va="center",
            transform=ax_val.transAxes,
            color="gray",
        )
    ax_val.set_title("Validation accuracy")
    ax_val.set_ylabel("accuracy")

    for ax in (ax_reward, ax_val, ax_len):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out


def plot_training_curves(metrics_jsonl_path: str | Path, out_png: str | Path) -> Path:
    """Plot reward, validation accuracy and response length vs step from a metrics JSONL file."""
    return plot_curves_from_records(read_metrics_jsonl(metrics_jsonl_path), out_png)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m verl.utils.plotting METRICS_JSONL OUT_PNG")
    print(plot_training_curves(sys.argv[1], sys.argv[2]))
