"""prime_math: answer extraction, PRM800K grading, lenient math_equal, the numina route."""

import signal
import time

import pytest

from verl.utils.reward_score import default_compute_score, prime_math
from verl.utils.reward_score.prime_math import _expr, grade_answer, match_answer
from verl.utils.reward_score.prime_math.grader import math_equal
from verl.utils.reward_score.prime_math.math_normalize import normalize_answer


@pytest.mark.parametrize(
    "response, expected",
    [
        ("Adding them, the answer is 42.", (True, "42.")),
        ("We get 5. Therefore the answer: 7", (True, "7")),
        ("so $x = \\boxed{\\frac{3}{4}}$ works", (True, "\\frac{3}{4}")),
        ("12 is the answer", (True, "12")),
        ("I cannot solve it", (False, "I cannot solve it")),
        ("the answer is x", (False, "x")),  # no digit: not matched
    ],
)
def test_match_answer(response, expected):
    assert match_answer(response) == expected


@pytest.mark.parametrize(
    "given, truth, correct",
    [
        ("\\frac{1}{2}", "0.5", True),  # MATH normalisation
        ("1,000", "1000", True),
        ("10 \\text{ cm}", "10", True),  # units dropped
        ("2\\sqrt{2}", "\\sqrt{8}", True),  # sympy
        ("x^2+2x+1", "(x+1)^2", True),
        ("7 3/4", "\\frac{31}{4}", True),  # a mixed number
        ("(1, 2]", "(1,2]", True),
        ("[1, 2]", "(1,2]", False),  # interval ends differ
        ("2/4", "1/2", False),  # unreduced fractions must match exactly
        ("3.0001", "3", False),  # an integer answer needs an exact integer
        ("5", "6", False),
        (None, "6", False),
        # the same matrix in other brackets (upstream's pylatexenc renders both as [a b; c d])
        (
            "\\begin{bmatrix} -7 & 6 \\\\ 11 & -9 \\end{bmatrix}",
            "\\begin{pmatrix}\n -7 & 6\\\\ 11 & -9\n\\end{pmatrix}",
            True,
        ),
        (
            "\\begin{bmatrix} -7 & 6 \\\\ 11 & -8 \\end{bmatrix}",
            "\\begin{pmatrix} -7 & 6 \\\\ 11 & -9 \\end{pmatrix}",
            False,
        ),
        (
            "\\begin{bmatrix} 1 & 2 \\end{bmatrix}",
            "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}",
            False,
        ),  # a row is no column
    ],
)
def test_grade_answer(given, truth, correct):
    assert grade_answer(given, truth) is correct


@pytest.mark.parametrize(
    "prediction, reference, equal",
    [
        ("0.5", "50", True),  # as a percentage
        ("0.5", "50.01", False),
        ("3.14159", "3.1416", True),  # relative tolerance 1e-4
        ("$12", "12", True),
        ("1011_2", "1011", True),  # base subscript
        ("3\\pi", "9.42477", True),
        ("Interval.Ropen(1, 2)", "[1, 2)", True),
        ("[1, 2]", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", True),
        ("1, 2, 3", "1,2,4", False),
        ("\\frac{\\sqrt{3}}{2}", "0.866025", True),  # numeric evaluation within tolerance
    ],
)
def test_math_equal(prediction, reference, equal):
    assert math_equal(prediction, reference) is equal


def test_compute_score_returns_correctness_format_and_answer():
    good = "Step 1: add.\nStep 2: so the answer is \\boxed{\\frac{1}{2}}"
    assert prime_math.compute_score(good, "0.5") == (True, True, "\\frac{1}{2}")
    assert prime_math.compute_score("The answer is \\boxed{3\\pi}", "9.42") == (True, False, "3\\pi")  # pi = 3.14
    assert prime_math.compute_score("The answer is \\boxed{4}", "5") == (False, False, "4")


def test_numina_sources_route_to_prime_math():
    for source in ("numina_cn_k12", "numina_olympiads", "numina_amc_aime"):
        assert default_compute_score(source, "so the answer is \\boxed{2\\sqrt{2}}", "\\sqrt{8}") == 1.0
        assert default_compute_score(source, "so the answer is \\boxed{3}", "\\sqrt{8}") == 0.0


def test_normalize_answer():
    assert normalize_answer("\\text{ 5 }") == "5"
    assert normalize_answer("1/2") == normalize_answer("0.5") == normalize_answer("\\dfrac{1}{2}") == "\\frac{1}{2}"
    assert normalize_answer(None) is None


def test_model_output_never_reaches_python_eval():
    assert not _expr.is_safe("__import__('os').system('x')")
    assert not _expr.is_safe("lambda: 1")
    assert _expr.is_safe("2*sqrt(2)+x^2")
    with pytest.raises(ValueError, match="not a plain math expression"):
        _expr.parse("().__class__")
    assert prime_math.compute_score("\\boxed{__import__('os').getcwd()}", "5")[0] is False


def test_latex_to_text():
    assert (
        _expr.latex_to_text("\\frac{a+b}{2}+\\sqrt[3]{x}\\cdot\\left(y\\right)^{2n}") == "(a+b)/2+(x)^(1/(3))*(y)^(2n)"
    )
    assert _expr.latex_to_text("\\dfrac12") == "1/2"
    assert _expr.latex_to_text("\\begin{pmatrix} \\frac{1}{2} & x \\\\ 3 & 4 \\end{pmatrix}+y") == "[1/2 x; 3 4]+y"
    assert _expr.latex_to_text("\\begin{smallmatrix} 1 \\\\ 2 \\end{smallmatrix}") == "[1; 2]"


def test_within_deadline_interrupts_and_rearms_an_outer_timer():
    fired = []
    previous = signal.signal(signal.SIGALRM, lambda *_: fired.append(True))
    try:
        signal.setitimer(signal.ITIMER_REAL, 60.0)  # an outer per-sample timer, as the prime manager arms
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            _expr.within_deadline(time.sleep, 0.2, 30.0)
        # bounds far from the failure modes (a 30 s sleep run to its end; an outer timer left at 0 or
        # its full 60 s), so that a loaded machine, slow by seconds, cannot fail the test
        elapsed = time.monotonic() - start
        assert elapsed < 20.0, f"the 0.2 s deadline stopped the call only after {elapsed:.1f} s"
        remaining, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 40.0 < remaining < 60.0, f"the outer timer was not re-armed (remaining {remaining})"
        assert signal.getsignal(signal.SIGALRM) is not _expr._on_alarm
        assert _expr.within_deadline(sum, 1.0, [1, 2]) == 3
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert not fired
