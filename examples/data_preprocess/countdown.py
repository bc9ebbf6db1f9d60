"""Build the Countdown task in verl's RL parquet schema: reach a target with given numbers, each used once.

    python examples/data_preprocess/countdown.py --local_dir ~/data/countdown              # generated offline
    python examples/data_preprocess/countdown.py --local_dataset_path tasks.parquet --local_dir ~/data/countdown
    python examples/data_preprocess/countdown.py --hub --local_dir ~/data/countdown        # Jiayi-Pan/Countdown-Tasks-3to4

By default problems are generated here, so no download is needed: 3-4 numbers from 1-99 are combined
by a random expression tree (+, -, *, and / when it divides exactly) and the result, if it is an
integer in [1, 999], is the target. Every generated problem is therefore solvable; the expression is
kept in ``extra_info.solution``. Test problems never repeat a training problem.

``--local_dataset_path`` (a parquet/JSON file) or ``--hub`` read existing problems instead, with columns
``target`` and ``nums``; the last ``--test_size`` rows become the test split.

Rows: data_source "countdown", prompt (one user message asking for the equation inside <answer> tags),
ability "math", reward_model {style "rule", ground_truth {target, numbers}}, extra_info {split, index}.
"""

from __future__ import annotations

import argparse
import os
import random
from fractions import Fraction

from verl.utils.dataset.files import read_rows, write_parquet

DATA_SOURCE = "countdown"
HUB_DATASET = "Jiayi-Pan/Countdown-Tasks-3to4"


def make_prompt(numbers: list[int], target: int) -> str:
    return (
        f"Using each of the numbers {numbers} exactly once, write an equation that equals {target}. "
        "You may use +, -, * and / and parentheses. Think it through inside <think> </think> tags, then give "
        "only the equation inside <answer> </answer> tags, for example <answer> (1 + 2) * 3 </answer>."
    )


def generate_problem(rng: random.Random, min_numbers: int, max_numbers: int, max_number: int):
    """(numbers, target, solution) built from a random expression tree, or None if the result is unusable."""
    numbers = [rng.randint(1, max_number) for _ in range(rng.randint(min_numbers, max_numbers))]
    pool = [(Fraction(n), str(n)) for n in numbers]
    while len(pool) > 1:
        (a, a_text), (b, b_text) = (pool.pop(rng.randrange(len(pool))) for _ in range(2))
        ops = ["+", "-", "*"] + (["/"] if b != 0 and (a / b).denominator == 1 else [])
        op = rng.choice(ops)
        value = a + b if op == "+" else a - b if op == "-" else a * b if op == "*" else a / b
        pool.append((value, f"({a_text} {op} {b_text})"))
    value, text = pool[0]
    if value.denominator != 1 or not 1 <= value <= 999:
        return None
    return numbers, int(value), text[1:-1] if text.startswith("(") else text


def generate(num: int, seed: int, min_numbers: int, max_numbers: int, max_number: int, exclude=frozenset()):
    rng = random.Random(seed)
    problems, seen = [], set(exclude)
    for _ in range(100 * num):
        if len(problems) == num:
            break
        problem = generate_problem(rng, min_numbers, max_numbers, max_number)
        if problem is None:
            continue
        key = (tuple(sorted(problem[0])), problem[1])
        if key not in seen:
            seen.add(key)
            problems.append(problem)
    if len(problems) < num:
        raise SystemExit(f"found only {len(problems)} distinct problems of the {num} asked; raise --max_number")
    return problems, seen


def make_row(numbers, target, split: str, index: int, solution: str | None = None) -> dict:
    numbers, target = [int(n) for n in numbers], int(target)
    extra_info = {"split": split, "index": index}
    if solution is not None:
        extra_info["solution"] = solution
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": make_prompt(numbers, target)}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": {"target": target, "numbers": numbers}},
        "extra_info": extra_info,
    }


def load_existing(args) -> list[dict]:
    if args.local_dataset_path:
        return read_rows(args.local_dataset_path)
    try:
        import datasets
    except ImportError:
        raise SystemExit(
            "--hub needs the `datasets` package (pip install datasets); or pass --local_dataset_path"
        ) from None
    return list(datasets.load_dataset(HUB_DATASET, split="train"))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--local_dir", "--local_save_dir", dest="local_dir", default="~/data/countdown")
    parser.add_argument("--local_dataset_path", default=None, help="parquet/JSON file with target and nums columns")
    parser.add_argument("--hub", action="store_true", help=f"download {HUB_DATASET} instead of generating")
    parser.add_argument("--train_size", type=int, default=10000)
    parser.add_argument("--test_size", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min_numbers", type=int, default=3)
    parser.add_argument("--max_numbers", type=int, default=4)
    parser.add_argument("--max_number", type=int, default=99)
    args = parser.parse_args(argv)
    if not 2 <= args.min_numbers <= args.max_numbers:
        parser.error("need 2 <= --min_numbers <= --max_numbers")

    if args.local_dataset_path or args.hub:
        existing = load_existing(args)
        if len(existing) <= args.test_size:
            raise SystemExit(f"only {len(existing)} problems, not more than --test_size={args.test_size}")
        split_rows = {
            "train": [(ex["nums"], ex["target"], None) for ex in existing[: -args.test_size][: args.train_size]],
            "test": [(ex["nums"], ex["target"], None) for ex in existing[-args.test_size :]],
        }
    else:
        common = (args.min_numbers, args.max_numbers, args.max_number)
        train, seen = generate(args.train_size, args.seed, *common)
        test, _ = generate(args.test_size, args.seed + 1, *common, exclude=seen)
        split_rows = {"train": train, "test": test}

    local_dir = os.path.expanduser(args.local_dir)
    for split, problems in split_rows.items():
        rows = [make_row(nums, target, split, i, solution) for i, (nums, target, solution) in enumerate(problems)]
        path = write_parquet(rows, os.path.join(local_dir, f"{split}.parquet"))
        print(f"wrote {len(rows)} {split} rows to {path}")


if __name__ == "__main__":
    main()
