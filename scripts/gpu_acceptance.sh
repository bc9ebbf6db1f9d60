#!/usr/bin/env bash
# GPU acceptance in one call (see scripts/gpu_acceptance.py for the steps and the report):
#
#   bash scripts/gpu_acceptance.sh OUT_DIR [--bundle DIR] [--budget-s 480] [--only a,b] [--cpu-dry-run]
#
# Runs from this checkout (PYTHONPATH), offline: no hub or index is contacted. PYTHON picks the
# interpreter (default python3). Exit status 0 only when every step that ran passed.
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ $# -lt 1 ] || [[ "$1" == -* ]]; then
  echo "usage: bash scripts/gpu_acceptance.sh OUT_DIR [--bundle DIR] [--budget-s N] [--only a,b] [--cpu-dry-run]" >&2
  exit 2
fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export RAY_USAGE_STATS_ENABLED=0 RAY_DEDUP_LOGS=0
exec "${PYTHON:-python3}" "$REPO/scripts/gpu_acceptance.py" "$@"
