"""DAPO's math reward (upstream's `verl.utils.reward_score.math_dapo`): the data sources `math_dapo`,
`math`, `math_dapo_reasoning` and `aime*` (DAPO-Math-17k, AIME) are scored here by
`default_compute_score`.

The answer is the last `Answer: ...` line of the response's last 300 characters (DAPO's prompt asks
for one), normalised as Minerva / lm-evaluation-harness normalise MATH answers, and compared with the
normalised ground truth as text. With `strict_box_verify` it is instead the last `\\boxed{...}` of the
response's last 100 characters, compared with the ground truth exactly. The score is +1 when they
match and -1 otherwise (not 0: DAPO's reward), returned as upstream's dict `{"score", "acc", "pred"}`.
"""

from __future__ import annotations

import re

# Minerva's answer normalisation, in its order: plain replacements, then words and TeX that carry no value
_REPLACE = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)
_DROP = (
    *(
        [
            "square",
            "ways",
            "integers",
            "dollars",
            "mph",
            "inches",
            "hours",
            "km",
            "units",
            "\\ldots",
            "sue",
            "points",
            "feet",
            "minutes",
            "digits",
        ]
    ),
    *(
        [
            "cents",
            "degrees",
            "cm",
            "gm",
            "pounds",
            "meters",
            "meals",
            "edges",
            "students",
            "childrentickets",
            "multiples",
        ]
    ),
    "\\text{s}",
    "\\text{.}",
    "\\text{\ns}",
    "\\text{}^2",
    "\\text{}^3",
    "\\text{\n}",
    "\\text{}",
    "\\mathrm{th}",
    "^\\circ",
    "^{\\circ}",
    "\\;",
    ",\\!",
    "{,}",
    '"',
    "\\dots",
)
_UNWRAP = (  # (pattern, replacement) applied in order
    (re.compile(r"(.*?)(\$)(.*?)(\$)(.*)"), r"$\3$"),  # keep the first $...$ span
    (re.compile(r"(\\text\{)(.*?)(\})"), r"\2"),
    (re.compile(r"(\\textbf\{)(.*?)(\})"), r"\2"),
    (re.compile(r"(\\overline\{)(.*?)(\})"), r"\2"),
    (re.compile(r"(\\boxed\{)(.*)(\})"), r"\2"),
    (re.compile(r"(frac)([^{])(.)"), r"frac{\2}{\3}"),  # \fracab -> \frac{a}{b}
    (re.compile(r"(sqrt)([^{])"), r"sqrt{\2}"),  # \sqrta -> \sqrt{a}
)
ANSWER_PATTERN = r"(?i)Answer\s*:\s*([^\n]+)"
INVALID = "[INVALID]"
_BOXED = "\\boxed{"


def last_boxed_only_string(string: str) -> str | None:
    """The last `\\boxed{...}` of `string` with balanced braces, the command included; None when
    there is none or its braces never close. (Only `\\boxed{`: not `\\fbox` or `\\boxed x`, which
    `math_reward` also reads.)"""
    start = string.rfind(_BOXED)
    if start < 0:
        return None
    depth = 0
    for end in range(start, len(string)):
        depth += {"{": 1, "}": -1}.get(string[end], 0)
        if string[end] == "}" and depth == 0:
            return string[start : end + 1]
    return None


def remove_boxed(boxed: str) -> str:
    """`\\boxed{x}` -> `x`."""
    if not (boxed.startswith(_BOXED) and boxed.endswith("}")):
        raise ValueError(f"not a \\boxed{{...}} answer: {boxed!r}")
    return boxed[len(_BOXED) : -1]


def normalize_final_answer(final_answer: str) -> str:
    """The answer after its last `=`, with units, words and TeX decoration removed, shorthand TeX
    spelled out, `$` dropped and thousands separators removed from a plain integer."""
    text = final_answer.split("=")[-1]
    for old, new in _REPLACE:
        text = text.replace(old, new)
    for word in _DROP:
        text = text.replace(word, "")
    for pattern, replacement in _UNWRAP:
        text = pattern.sub(replacement, text)
    text = text.replace("$", "")
    if text.replace(",", "").isdigit():
        text = text.replace(",", "")
    return text.strip()


def is_correct_minerva(
    solution_str: str, gt: str, gt_need_extract: bool = False, answer_pattern: str = ANSWER_PATTERN
) -> tuple[bool, str]:
    """(whether the last `answer_pattern` match equals the ground truth after normalisation, the
    normalised prediction; `[INVALID]` when the response has no answer line). `gt_need_extract`:
    the ground truth is a solution whose last `\\boxed{}` holds the answer."""
    matches = re.findall(answer_pattern, solution_str)
    pred = normalize_final_answer(matches[-1] if matches else INVALID)
    if gt_need_extract:
        boxed = last_boxed_only_string(gt)
        gt = remove_boxed(boxed) if boxed is not None else gt
    return pred == normalize_final_answer(gt), pred


def is_correct_strict_box(pred: str, gt: str, pause_tokens_index: list[int] | None = None) -> tuple[int, str | None]:
    """(1 if the last `\\boxed{}` of the response's tail equals `gt` exactly, else -1; the boxed text
    or None). The tail is the last 100 characters, or from 100 before the last pause token."""
    if pause_tokens_index is not None:
        if len(pause_tokens_index) != 4:
            raise ValueError(f"pause_tokens_index must hold 4 indices, got {pause_tokens_index}")
        tail = pred[pause_tokens_index[-1] - 100 :]
    else:
        tail = pred[-100:]
    boxed = last_boxed_only_string(tail)
    extracted = remove_boxed(boxed) if boxed is not None else None
    return (1 if extracted == gt else -1), extracted


def verify(
    solution_str: str, answer: str, strict_box_verify: bool = False, pause_tokens_index: list[int] | None = None
) -> tuple[bool, str | None]:
    """(correct, prediction) by the strict boxed rule or Minerva's."""
    if strict_box_verify:
        score, pred = is_correct_strict_box(solution_str, answer, pause_tokens_index)
        return score == 1, pred
    return is_correct_minerva(solution_str, answer)


def compute_score(
    solution_str: str,
    ground_truth: str,
    strict_box_verify: bool = False,
    pause_tokens_index: list[int] | None = None,
) -> dict:
    """{"score": 1.0 or -1.0, "acc": correct, "pred": the prediction} for the response's last 300
    characters (the longest MATH-500 answer has 159)."""
    correct, pred = verify(solution_str[-300:], ground_truth, strict_box_verify, pause_tokens_index)
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}
