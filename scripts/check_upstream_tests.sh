#!/usr/bin/env bash
# Run upstream verl's own CPU unit tests (its `tests/**/*_on_cpu.py`, the files upstream's CPU CI job runs)
# unchanged against this checkout: the measure of "upstream users' Python code works here unchanged" on
# the public API those tests exercise (DataProto, TensorDict helpers, config dataclasses, registries,
# the single controller's dispatch, datasets, reward scorers, rollout tracing, ...).
#
#   bash scripts/check_upstream_tests.sh /path/to/upstream-verl [tests/some_file_on_cpu.py ...]
#
# /path/to/upstream-verl is a checkout of https://github.com/volcengine/verl (only its tests/ is read).
# The tests are copied into a scratch directory beside symlinks to this checkout's `verl` and `scripts`
# (upstream's tests import `tests.*`, read `verl/trainer/config` relative to the working directory and
# run `scripts/print_cfg.py`), and each file runs in its own pytest process from there, so `import verl`
# is this checkout's package. One line per file, then the totals; the exit status is non-zero when a
# test fails that is not listed below as needing what this machine cannot have.
#
# Upstream's CPU job runs pytest with --asyncio-mode=auto; so does this script when pytest-asyncio
# (upstream's requirements-test.txt; this project's test extra) is importable.
#
# Deselected, with the reason (environment only, not API):
#   - tokenizers that upstream's tests load from ~/models/<hub id> (deepseek-coder, Qwen2-VL): no model
#     hub here; the same dataset code is tested in tests/utils/dataset on the bundled tokenizers.
#   - tests that call a live SandboxFusion service (they skip themselves when SANDBOX_FUSION_URL is unset).
#   - two TensorDict tests that check tensordict's own `torch.cat` / `consolidate()` behaviour, which
#     changed after 0.10 (upstream pins tensordict<=0.10.0; this project runs 0.15): they pass with 0.10.
set -euo pipefail
UPSTREAM="${1:?usage: $0 UPSTREAM_VERL_CHECKOUT [tests/..._on_cpu.py ...]}"
shift
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python}"
[[ -d "$UPSTREAM/tests" ]] || { echo "error: $UPSTREAM/tests not found; pass a checkout of volcengine/verl" >&2; exit 2; }

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
cp -r "$UPSTREAM/tests" "$WORK/tests"
ln -s "$ROOT/verl" "$WORK/verl"
ln -s "$ROOT/scripts" "$WORK/scripts"

DESELECT=(
  # ~/models/deepseek-ai/deepseek-coder-1.3b-instruct, ~/models/Qwen/Qwen2-VL-2B-Instruct (hub downloads)
  tests/utils/dataset/test_rl_dataset_on_cpu.py::test_rl_dataset
  tests/utils/dataset/test_rl_dataset_on_cpu.py::test_rl_dataset_with_max_samples
  tests/utils/dataset/test_rl_dataset_on_cpu.py::test_image_rl_data
  tests/utils/dataset/test_rl_dataset_on_cpu.py::test_video_rl_data
  # ~/models/deepseek-ai/DeepSeek-Coder-V2-Lite-Instruct (hub download)
  tests/utils/dataset/test_sft_dataset_on_cpu.py::test_sft_cot_dataset
  tests/utils/dataset/test_sft_dataset_on_cpu.py::test_sft_dataset
  tests/utils/dataset/test_sft_dataset_on_cpu.py::test_sft_dataset_with_max_samples
  # ~/models/Qwen/Qwen2.5-0.5B-Instruct (its fixture's tokenizer, every test of the file)
  tests/experimental/reward_loop/test_rate_limited_reward_manager_on_cpu.py
  # ~/models/Qwen/{Qwen2.5-0.5B, Qwen2.5-Coder-7B-Instruct, Qwen3-30B-A3B-Instruct-2507, Qwen2-VL-2B-Instruct}
  tests/utils/dataset/test_multiturn_sft_dataset_on_cpu.py::test_multiturn_sft_dataset
  tests/utils/dataset/test_multiturn_sft_dataset_on_cpu.py::test_multiturn_sft_vlm_dataset_on_cpu
  tests/utils/dataset/test_multiturn_sft_dataset_on_cpu.py::test_multiturn_sft_vlm_dataloader_on_cpu
  # tensordict's own behaviour after 0.10 (see above)
  tests/test_protocol_v2_on_cpu.py::test_chunk_concat
  tests/test_protocol_v2_on_cpu.py::test_contiguous
)
PYTEST_ARGS=()
if "$PY" -c "import pytest_asyncio" 2>/dev/null; then
  PYTEST_ARGS+=(--asyncio-mode=auto)
else
  echo "warning: pytest-asyncio is not importable; upstream's async tests will fail (see the header)" >&2
fi
for t in "${DESELECT[@]}"; do PYTEST_ARGS+=(--deselect "$t"); done

cd "$WORK"
if [[ $# -gt 0 ]]; then FILES=("$@"); else mapfile -t FILES < <(find tests -name "*_on_cpu.py" | sort); fi
failed=0
for f in "${FILES[@]}"; do
  set +e
  "$PY" -m pytest -q -p no:cacheprovider -rfE --tb=short "${PYTEST_ARGS[@]}" "$f" > "$WORK/log" 2>&1
  rc=$?
  set -e
  echo "$([[ $rc -eq 0 || $rc -eq 5 ]] && echo ok || echo FAIL) $f: $(tail -1 "$WORK/log")"
  if [[ $rc -ne 0 && $rc -ne 5 ]]; then
    failed=$((failed + 1))
    grep -E "^(FAILED|ERROR) " "$WORK/log" | sed 's/^/    /' || true
  fi
done
echo "upstream CPU tests: ${#FILES[@]} files, $failed with failures (${#DESELECT[@]} deselected: environment or dependency version)"
[[ $failed -eq 0 ]]
