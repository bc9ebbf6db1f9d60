"""The arithmetic task: seeded problems in upstream verl's RL parquet schema, and a greedy evaluator.

Each row is what `examples/data_preprocess/*.py` produce upstream:
`data_source="arith"`, `prompt=[{"role": "user", "content": "What is 37+48?"}]`, `ability="math"`,
`reward_model={"style": "rule", "ground_truth": "85"}`,
`extra_info={"split", "index", "answer", "question", "expression"}`. `expression` is a Python
expression of the same arithmetic (fully parenthesised for word problems), so anyone can check a
ground truth independently.

Design decisions:
- The default task is 2-digit addition (operands 10..99) with 500 held-out problems: small enough
  for a ~1M-parameter model to learn on CPU in minutes, and the bundled `arith-tiny` checkpoint is
  trained on exactly this task.
- Splits are disjoint by arithmetic, not by wording: two problems with the same expression are the
  same problem even if a word problem names a different person. The test split is drawn first, from
  the seed alone, so it does not change when `num_train` changes. Within a split problems are
  distinct; asking for more problems than exist is an error, not silent duplication.
- Plain multi-step prompts ("What is 12+34*5?") follow the usual precedence (`*` before `+`/`-`);
  multi-step word problems apply their operations in the order told ("Start with 12. Add 34.
  Multiply by 5."). Subtraction may give negative answers in plain style; one-step word problems
  never do (the operands are ordered so nothing is "left" below zero).
- The evaluator reads the first integer of a greedy completion (an optional minus sign included),
  the same strict rule as the rule-based reward `verl/utils/reward_score/arith.py`.
"""

from __future__ import annotations

import os
import random
import re
import uuid
from dataclasses import dataclass

DATA_SOURCE = "arith"
OPS = ("+", "-", "*")
STYLES = ("plain", "word")
DEFAULT_NUM_TRAIN = 5000
DEFAULT_NUM_TEST = 500

_NAMES = ("Ann", "Ben", "Cara", "Dan", "Eve", "Finn", "Gia", "Hugo")
_ITEMS = ("apple", "pen", "coin", "card", "book", "shell")
_STEP_WORDS = {"+": "Add {x}.", "-": "Subtract {x}.", "*": "Multiply by {x}."}


@dataclass(frozen=True)
class ArithTask:
    """Which problems to generate."""

    digits: int = 2
    """Digits per operand: operands are 10**(digits-1)..10**digits-1 (0..9 for one digit)."""
    ops: tuple[str, ...] = ("+",)
    """Operations drawn uniformly for each step, a subset of `+ - *`."""
    steps: int = 1
    """Operations per problem: 1 gives `a+b`, 2 gives `a+b*c`, and so on."""
    style: str = "plain"
    """`plain` ("What is 37+48?") or `word` (a short story, or a chain of instructions for steps > 1)."""

    def __post_init__(self):
        if not 1 <= self.digits <= 9:
            raise ValueError(f"digits={self.digits} is out of range; use 1 to 9 digits per operand")
        if not self.ops or any(op not in OPS for op in self.ops) or len(set(self.ops)) != len(self.ops):
            raise ValueError(f"ops={self.ops!r} must be distinct operations from {list(OPS)}, e.g. ('+', '-')")
        if self.steps < 1:
            raise ValueError(f"steps={self.steps} must be at least 1 (one operation per problem)")
        if self.style not in STYLES:
            raise ValueError(f"style={self.style!r} is not one of {list(STYLES)}")

    @property
    def operand_range(self) -> tuple[int, int]:
        low = 0 if self.digits == 1 else 10 ** (self.digits - 1)
        return low, 10**self.digits - 1

    @property
    def num_distinct_problems(self) -> int:
        low, high = self.operand_range
        n = high - low + 1
        if self.style == "word" and self.steps == 1:  # a subtraction story always takes the larger first
            return sum(n * (n + 1) // 2 if op == "-" else n * n for op in self.ops)
        return n ** (self.steps + 1) * len(self.ops) ** self.steps


@dataclass(frozen=True)
class Problem:
    question: str
    expression: str
    answer: int


def evaluate_plain(operands: list[int], ops: list[str]) -> int:
    """Value of `operands[0] ops[0] operands[1] ...` with `*` binding tighter than `+` and `-`."""
    terms, signs = [operands[0]], []
    for op, x in zip(ops, operands[1:]):
        if op == "*":
            terms[-1] *= x
        else:
            terms.append(x)
            signs.append(op)
    total = terms[0]
    for sign, term in zip(signs, terms[1:]):
        total = total + term if sign == "+" else total - term
    return total


def evaluate_in_order(operands: list[int], ops: list[str]) -> int:
    """Value of applying `ops` left to right, ignoring precedence (how word problems read)."""
    total = operands[0]
    for op, x in zip(ops, operands[1:]):
        total = total + x if op == "+" else total - x if op == "-" else total * x
    return total


def sample_problem(rng: random.Random, task: ArithTask) -> Problem:
    low, high = task.operand_range
    operands = [rng.randint(low, high) for _ in range(task.steps + 1)]
    ops = [rng.choice(task.ops) for _ in range(task.steps)]
    if task.style == "plain":
        expression = "".join(str(x) + op for x, op in zip(operands, ops)) + str(operands[-1])
        return Problem(f"What is {expression}?", expression, evaluate_plain(operands, ops))
    if task.steps == 1:
        return _story_problem(rng, operands, ops[0])
    expression = str(operands[0])
    for op, x in zip(ops, operands[1:]):
        expression = f"({expression}{op}{x})"
    steps = " ".join(_STEP_WORDS[op].format(x=x) for op, x in zip(ops, operands[1:]))
    question = f"Start with {operands[0]}. {steps} What is the result?"
    return Problem(question, expression, evaluate_in_order(operands, ops))


def _story_problem(rng: random.Random, operands: list[int], op: str) -> Problem:
    a, b = operands
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    if op == "+":
        question = f"{name} has {a} {item}s and gets {b} more. How many {item}s does {name} have now?"
    elif op == "-":
        a, b = max(a, b), min(a, b)
        question = f"{name} has {a} {item}s and gives away {b}. How many {item}s are left?"
    else:
        question = f"{name} buys {a} boxes with {b} {item}s in each box. How many {item}s is that?"
    return Problem(question, f"{a}{op}{b}", evaluate_in_order([a, b], [op]))


def make_splits(task: ArithTask, num_train: int, num_test: int, seed: int = 0) -> tuple[list[Problem], list[Problem]]:
    """Distinct train and test problems with no expression in both; the test split depends only on
    `(task, num_test, seed)`."""
    if num_train < 0 or num_test < 0:
        raise ValueError(f"num_train={num_train} and num_test={num_test} must not be negative")
    capacity = task.num_distinct_problems
    if num_train + num_test > capacity:
        raise ValueError(
            f"num_train + num_test = {num_train + num_test} distinct problems requested, but {task} has only "
            f"{capacity}; lower num_train/num_test, or add digits, steps or ops"
        )
    rng = random.Random(seed)
    seen: set[str] = set()
    test = _draw_distinct(rng, task, num_test, seen)
    train = _draw_distinct(rng, task, num_train, seen)
    return train, test


def _draw_distinct(rng: random.Random, task: ArithTask, count: int, seen: set[str]) -> list[Problem]:
    problems = []
    while len(problems) < count:
        problem = sample_problem(rng, task)
        if problem.expression not in seen:
            seen.add(problem.expression)
            problems.append(problem)
    return problems


def problem_to_row(problem: Problem, split: str, index: int) -> dict:
    """One parquet row in upstream verl's RL schema."""
    answer = str(problem.answer)
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": problem.question}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {
            "split": split,
            "index": index,
            "answer": answer,
            "question": problem.question,
            "expression": problem.expression,
        },
    }


def make_arith_rows(
    num_train: int = DEFAULT_NUM_TRAIN,
    num_test: int = DEFAULT_NUM_TEST,
    digits: int = 2,
    ops: str | tuple[str, ...] = "+",
    steps: int = 1,
    style: str = "plain",
    seed: int = 0,
) -> tuple[list[dict], list[dict]]:
    """`(train_rows, test_rows)` for the task; `ops` is a string of operations like `"+-"` or a tuple."""
    task = ArithTask(digits=digits, ops=tuple(ops), steps=steps, style=style)
    train, test = make_splits(task, num_train, num_test, seed)
    return (
        [problem_to_row(p, "train", i) for i, p in enumerate(train)],
        [problem_to_row(p, "test", i) for i, p in enumerate(test)],
    )


def write_arith_parquet(
    out_dir: str,
    num_train: int = DEFAULT_NUM_TRAIN,
    num_test: int = DEFAULT_NUM_TEST,
    digits: int = 2,
    ops: str | tuple[str, ...] = "+",
    steps: int = 1,
    style: str = "plain",
    seed: int = 0,
) -> tuple[str, str]:
    """Write `train.parquet` and `test.parquet` under `out_dir` (each atomically) and return their paths."""
    train_rows, test_rows = make_arith_rows(num_train, num_test, digits, ops, steps, style, seed)
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for name, rows in (("train", train_rows), ("test", test_rows)):
        path = os.path.join(out_dir, f"{name}.parquet")
        _write_parquet_atomic(rows, path)
        paths.append(path)
    return paths[0], paths[1]


def _write_parquet_atomic(rows: list[dict], path: str) -> None:
    import pandas as pd

    # A unique temporary name in the same directory, then a rename: concurrent writers (several
    # ranks on first use) never expose a half-written file, and the last rename wins harmlessly.
    tmp = f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex}"
    try:
        pd.DataFrame(rows).to_parquet(tmp, index=False)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def default_cache_dir() -> str:
    """`$VERL_CACHE_DIR/data/arith`, with `VERL_CACHE_DIR` defaulting to `~/.cache/verl`."""
    root = os.environ.get("VERL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "verl")
    return os.path.join(root, "data", "arith")


def ensure_arith_data(cache_dir: str | None = None) -> tuple[str, str]:
    """Paths of the default task's `(train.parquet, test.parquet)`, generated on first use and
    reused afterwards."""
    cache_dir = cache_dir or default_cache_dir()
    train_path = os.path.join(cache_dir, "train.parquet")
    test_path = os.path.join(cache_dir, "test.parquet")
    if not (os.path.isfile(train_path) and os.path.isfile(test_path)):
        write_arith_parquet(cache_dir)
    return train_path, test_path


def load_rows(path: str) -> list[dict]:
    """Rows of a parquet file as plain dicts (list columns as lists, struct columns as dicts)."""
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()


_INTEGER = re.compile(r"-?\d+")


def extract_first_integer(text: str) -> int | None:
    """The first integer in `text` (with a leading minus sign if present), or None when there is none."""
    match = _INTEGER.search(text)
    return int(match.group()) if match else None


def evaluate_greedy_accuracy(model, tokenizer, rows: list[dict], batch_size: int = 250, max_new_tokens: int = 8):
    """Fraction of `rows` whose greedy completion's first integer equals `reward_model.ground_truth`.

    `rows` are dicts in the RL parquet schema (see `load_rows`). The model runs on whatever device
    its parameters are on; its train/eval mode is restored afterwards.
    """
    import torch

    if not rows:
        raise ValueError("evaluate_greedy_accuracy got no rows; pass the test split's rows (load_rows(test_path))")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    correct = 0
    try:
        for start in range(0, len(rows), batch_size):
            batch = rows[start : start + batch_size]
            texts = [
                tokenizer.apply_chat_template(list(row["prompt"]), add_generation_prompt=True, tokenize=False)
                for row in batch
            ]
            enc = tokenizer(texts, add_special_tokens=False, padding=True, padding_side="left", return_tensors="pt")
            with torch.no_grad():
                out = model.generate(
                    input_ids=enc["input_ids"].to(device),
                    attention_mask=enc["attention_mask"].to(device),
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    pad_token_id=tokenizer.pad_token_id,
                    eos_token_id=tokenizer.eos_token_id,
                )
            completions = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
            for row, completion in zip(batch, completions):
                correct += extract_first_integer(completion) == int(row["reward_model"]["ground_truth"])
    finally:
        model.train(was_training)
    return correct / len(rows)
