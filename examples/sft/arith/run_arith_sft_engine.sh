#!/usr/bin/env bash
# SFT through the training-engine API (upstream's `verl.trainer.sft_trainer`) on CPU (or GPU: drop
# trainer.device=cpu): a fresh tiny model on the arithmetic task, in upstream's multi-turn layout (a
# `messages` column), with 2 ranks on the FSDP engine; pass `engine=megatron optim=megatron` for the
# Megatron engine. Usage: bash examples/sft/arith/run_arith_sft_engine.sh [NPROC] [key=value ...]
set -euo pipefail
nproc=${1:-2}
shift || true
data_dir=${DATA_DIR:-$HOME/data/arith}
model_dir=${MODEL_DIR:-$HOME/models/tiny-init}
save_dir=${SAVE_DIR:-checkpoints/arith-sft-engine/tiny}

[ -f "$data_dir/train.parquet" ] || python examples/data_preprocess/arith.py --local_dir "$data_dir"
[ -f "$model_dir/config.json" ] || python -m verl.models.make_tiny --preset tiny --out "$model_dir"
# prompt + answer -> one conversation per row (user turn, assistant turn)
for split in train test; do
    [ -f "$data_dir/${split}_messages.parquet" ] || python - "$data_dir/$split.parquet" "$data_dir/${split}_messages.parquet" <<'PY'
import sys

import pandas as pd

df = pd.read_parquet(sys.argv[1])
messages = [[*list(p), {"role": "assistant", "content": e["answer"]}] for p, e in zip(df["prompt"], df["extra_info"])]
pd.DataFrame({"messages": messages}).to_parquet(sys.argv[2])
PY
done

torchrun --standalone --nnodes=1 --nproc_per_node="$nproc" -m verl.trainer.sft_trainer \
    data.train_files="$data_dir/train_messages.parquet" \
    data.val_files="$data_dir/test_messages.parquet" \
    data.messages_key=messages \
    data.train_batch_size=64 \
    data.max_token_len_per_gpu=2048 \
    data.micro_batch_size_per_gpu=32 \
    data.max_length=64 \
    model.path="$model_dir" \
    engine.dtype=fp32 \
    optim.lr=1e-3 \
    trainer.default_local_dir="$save_dir" \
    trainer.total_epochs=3 \
    trainer.test_freq=20 \
    trainer.logger="['console','file']" \
    trainer.device=cpu "$@"
