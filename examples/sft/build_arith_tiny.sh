#!/usr/bin/env bash
# Rebuild the bundled verl/assets/arith-tiny model from scratch: a fresh ~1M-parameter Qwen2 is
# fine-tuned by a seeded single-threaded SFT loop on 2-digit addition and stopped at the first held-out
# evaluation with 25-50% greedy accuracy. Takes a few minutes on 2 CPU cores. Extra arguments go to
# the builder (see `python -m verl.models.build_bundled --help`), e.g. --out /tmp/arith-tiny.
set -euo pipefail
python -m verl.models.build_bundled "$@"
