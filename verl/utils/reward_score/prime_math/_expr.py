"""LaTeX answers as plain math text, parsed by sympy safely and within a deadline.

- `latex_to_text`: `\\frac{a+b}{c}` -> `(a+b)/c`, `\\sqrt{x}` -> `sqrt(x)`, `\\sqrt[3]{x}` ->
  `(x)^(1/(3))`, `\\pi` -> `pi`, `\\infty` -> `inf`, `\\cdot`/`\\times` -> `*`, `x^{a+b}` ->
  `x^(a+b)`, text macros unwrapped, spacing and `\\left`/`\\right` dropped, other macros lose
  their backslash. A `pmatrix`, `bmatrix` or `smallmatrix` becomes `[a b; c d]` whatever its
  delimiters, as pylatexenc renders them, so `\\begin{bmatrix}...` answers a `pmatrix` ground truth. It replaces the pylatexenc conversion upstream uses (not a dependency here).
- `parse`: a sympy expression from such text. sympy's `parse_expr` evaluates the text as Python,
  so model output is never handed to it unchecked: only digits, lower-case letters, operators,
  parentheses, dots, commas and spaces pass, and every name must be a known math name or one
  letter (a symbol) -- no attribute access, no strings, no calls of arbitrary names.
- `within_deadline(fn, seconds)`: sympy can take minutes on some inputs (`simplify` of a huge
  power). On the main thread a SIGALRM timer interrupts it, cooperating with a timer that is
  already armed (the prime reward manager's per-sample one: the earlier deadline wins, the outer
  timer is re-armed afterwards); elsewhere the call runs in a child process that is killed at the
  deadline (`verl.utils.py_functional.timeout_limit`).
"""

from __future__ import annotations

import re
import signal
import threading
import time
from collections.abc import Callable

_MACRO = re.compile(r"\\([A-Za-z]+|.)")
_SAFE_TEXT = re.compile(r"[0-9a-z+\-*/^()., ]*")
_NAME = re.compile(r"[a-z]+")
_KNOWN_NAMES = frozenset({"sqrt", "pi", "oo", "inf", "sin", "cos", "tan", "log", "ln", "exp", "e", "i"})
_TEXT_MACROS = frozenset({"text", "textbf", "textit", "textrm", "mathrm", "mathbf", "mathit", "mbox", "operatorname"})
_BRACKET_MATRICES = frozenset({"pmatrix", "bmatrix", "smallmatrix"})
_DROPPED_MACROS = frozenset({"left", "right", "displaystyle", "limits", "big", "Big", "bigl", "bigr", "Bigl", "Bigr"})
_SYMBOLS = {
    "pi": "pi",
    "infty": "inf",
    "cdot": "*",
    "times": "*",
    "div": "/",
    "le": "<=",
    "leq": "<=",
    "ge": ">=",
    "geq": ">=",
    "ne": "!=",
    "neq": "!=",
    "pm": "+-",
    "%": "%",
    "$": "$",
    "{": "{",
    "}": "}",
    ",": "",
    "!": "",
    ";": "",
    ":": "",
    " ": "",
    "quad": " ",
    "qquad": " ",
}


def _group(text: str, start: int) -> tuple[str, int]:
    """The content of the brace group opening at `text[start]` (or the single character there) and
    the index after it."""
    if start >= len(text):
        return "", start
    if text[start] != "{":
        if text[start] == "\\":
            match = _MACRO.match(text, start)
            return match.group(0), match.end()
        return text[start], start + 1
    depth = 0
    for pos in range(start, len(text)):
        if text[pos] == "{":
            depth += 1
        elif text[pos] == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : pos], pos + 1
    return text[start + 1 :], len(text)


def _wrap(text: str) -> str:
    """Parenthesise a compound operand (anything but a bare number or name)."""
    return text if re.fullmatch(r"[0-9.]+|[A-Za-z]+", text) else f"({text})"


def _skip_spaces(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] == " ":
        pos += 1
    return pos


def _matrix_text(expr: str, pos: int) -> tuple[str, int] | None:
    """`[a b; c d]` for the bracket matrix environment whose `\\begin` ends at `pos`, and the index
    after its `\\end`; None when no such environment starts there."""
    name, body_start = _group(expr, _skip_spaces(expr, pos))
    if name not in _BRACKET_MATRICES:
        return None
    end_tag = "\\end{" + name + "}"
    body_end = expr.find(end_tag, body_start)
    body_end = len(expr) if body_end < 0 else body_end
    rows = [row for row in expr[body_start:body_end].split("\\\\") if row.strip()]
    cells = [" ".join(latex_to_text(cell) for cell in row.split("&")) for row in rows]
    return "[" + "; ".join(cells) + "]", min(len(expr), body_end + len(end_tag))


def latex_to_text(expr: str) -> str:
    """Plain math text of a LaTeX expression (see the module docstring)."""
    out: list[str] = []
    pos = 0
    while pos < len(expr):
        char = expr[pos]
        if char == "\\":
            match = _MACRO.match(expr, pos)
            name = match.group(1)
            pos = match.end()
            if name in ("frac", "dfrac", "tfrac", "cfrac"):
                numerator, pos = _group(expr, _skip_spaces(expr, pos))
                denominator, pos = _group(expr, _skip_spaces(expr, pos))
                out.append(f"{_wrap(latex_to_text(numerator))}/{_wrap(latex_to_text(denominator))}")
            elif name == "sqrt":
                pos = _skip_spaces(expr, pos)
                index = None
                if pos < len(expr) and expr[pos] == "[":
                    end = expr.find("]", pos)
                    end = len(expr) if end < 0 else end
                    index, pos = expr[pos + 1 : end], end + 1
                radicand, pos = _group(expr, _skip_spaces(expr, pos))
                radicand = latex_to_text(radicand)
                out.append(f"sqrt({radicand})" if index is None else f"({radicand})^(1/({latex_to_text(index)}))")
            elif name == "begin" and (matrix := _matrix_text(expr, pos)) is not None:
                text, pos = matrix
                out.append(text)
            elif name in _TEXT_MACROS:
                content, pos = _group(expr, _skip_spaces(expr, pos))
                out.append(latex_to_text(content))
            elif name in _DROPPED_MACROS:
                continue
            elif name in _SYMBOLS:
                out.append(_SYMBOLS[name])
            elif name == "\\":
                out.append(" ")
            else:
                out.append(name)
        elif char == "^":
            exponent, pos = _group(expr, _skip_spaces(expr, pos + 1))
            out.append("^" + _wrap(latex_to_text(exponent)))
        elif char in "{}":
            pos += 1
        else:
            out.append(char)
            pos += 1
    return "".join(out).strip()


def is_safe(text: str) -> bool:
    """Whether `text` may be handed to sympy's parser (see the module docstring)."""
    if not _SAFE_TEXT.fullmatch(text):
        return False
    return all(len(name) == 1 or name in _KNOWN_NAMES for name in _NAME.findall(text))


def parse(text: str):
    """A sympy expression of plain math text (`^` is a power, `2x` is `2*x`); ValueError when the text
    is not allowed or does not parse."""
    from sympy.parsing import sympy_parser

    text = text.strip().lower().replace("inf", "oo")
    if not text or not is_safe(text):
        raise ValueError(f"not a plain math expression: {text[:80]!r}")
    transformations = sympy_parser.standard_transformations + (
        sympy_parser.implicit_multiplication_application,
        sympy_parser.convert_xor,
    )
    try:
        return sympy_parser.parse_expr(text, transformations=transformations, evaluate=True)
    except Exception as e:  # sympy's parser raises many types (SyntaxError, TypeError, TokenError, ...)
        raise ValueError(f"sympy cannot parse {text[:80]!r}: {type(e).__name__}") from e


class _Deadline(Exception):
    pass


def _on_alarm(signum, frame):
    raise _Deadline


def within_deadline(fn: Callable, seconds: float, *args):
    """`fn(*args)`, or TimeoutError after `seconds` (see the module docstring)."""
    if threading.current_thread() is not threading.main_thread():
        from verl.utils.py_functional import timeout_limit

        return timeout_limit(seconds)(fn)(*args)
    outer_remaining, outer_interval = signal.getitimer(signal.ITIMER_REAL)
    if 0 < outer_remaining <= seconds:
        return fn(*args)  # the armed timer fires first; its own handler deals with it
    previous_handler = signal.signal(signal.SIGALRM, _on_alarm)
    started = time.monotonic()
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return fn(*args)
    except _Deadline:
        raise TimeoutError(f"gave up after {seconds} s") from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous_handler)
        if outer_remaining > 0:  # re-arm the outer timer with what is left of it
            signal.setitimer(
                signal.ITIMER_REAL, max(outer_remaining - (time.monotonic() - started), 1e-3), outer_interval
            )
