"""Code scoring on a SandboxFusion service (https://github.com/bytedance/SandboxFusion), as upstream's
`verl.utils.reward_score.sandbox_fusion`.

`compute_score(sandbox_fusion_url, concurrent_semaphore, memory_limit_mb, completion, test_cases,
continuous=False, timeout=10) -> (score, metadata)`:

- the program is the last ```` ```python ```` block of the completion, else the first fenced
  block (its language line dropped); a completion without a fenced block scores 0.0 with an
  error in the metadata;
- `test_cases` is a dict or its JSON text: `inputs` / `outputs` (stdin and expected stdout per
  case), optional `fn_name` (call a function with JSON-lines arguments), or `assert_case` (a list
  of assertion snippets appended to the program; inputs and outputs then default to empty);
- the score is the fraction of cases that pass (`continuous=True`: of the first 10 cases).

Each case runs on the service (`utils.check_correctness`); `concurrent_semaphore` (a
`threading.Semaphore`, shared by the reward workers of a process) bounds the requests in flight.
Malformed test cases raise `ValueError` (a data problem to fix, not a wrong answer); a service
that cannot be reached scores the cases as failed (-1) with the error in their metadata.
"""

from __future__ import annotations

import json

from verl.utils.reward_score.sandbox_fusion.utils import DEFAULT_MEMORY_LIMIT_MB, check_correctness

__all__ = ["compute_score", "extract_program"]

_CONTINUOUS_CASES = 10


def extract_program(completion: str) -> str | None:
    """The code of a completion's fenced block (see the module docstring); None without one."""
    if "```python" in completion:
        return completion.split("```python")[-1].split("```")[0]
    if "```" in completion:
        parts = completion.split("```")
        block = parts[1]
        if "\n" in block:
            first_line, rest = block.split("\n", 1)
            if first_line.strip().isalpha():  # a language tag such as ```cpp
                block = rest
        return block
    return None


def compute_score(
    sandbox_fusion_url: str,
    concurrent_semaphore,
    memory_limit_mb: int | None,
    completion: str,
    test_cases,
    continuous: bool = False,
    timeout: int = 10,
) -> tuple[float, list[dict]]:
    """(fraction of test cases passed, per-case metadata); see the module docstring."""
    program = extract_program(completion)
    if program is None:
        return 0.0, [{"error": "Invalid completion (missing code block)"}]
    if not isinstance(test_cases, dict):
        try:
            test_cases = json.loads(test_cases)
        except (TypeError, json.JSONDecodeError) as e:
            raise ValueError(f"sandbox_fusion: test_cases is neither a dict nor JSON text ({e})") from e
    test_cases = dict(test_cases)
    if isinstance(test_cases.get("assert_case"), list):
        asserts = test_cases["assert_case"]
        test_cases.setdefault("inputs", [""] * len(asserts))
        test_cases.setdefault("outputs", [None] * len(asserts))
    elif "inputs" not in test_cases or "outputs" not in test_cases:
        raise ValueError(
            f"sandbox_fusion: test_cases needs 'inputs' and 'outputs' (or 'assert_case'); it has {sorted(test_cases)}"
        )
    results, metadata = check_correctness(
        sandbox_fusion_url=sandbox_fusion_url,
        in_outs=test_cases,
        generation=program,
        timeout=timeout,
        memory_limit_mb=memory_limit_mb or DEFAULT_MEMORY_LIMIT_MB,
        concurrent_semaphore=concurrent_semaphore,
    )
    considered = results[:_CONTINUOUS_CASES] if continuous else results
    if not considered:
        return 0.0, metadata
    return sum(1 for r in considered if r is True) / len(considered), metadata
