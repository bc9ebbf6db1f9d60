#!/usr/bin/env bash
# SFT quickstart on CPU (or GPU: drop trainer.device=cpu): fine-tune a fresh tiny model on the
# arithmetic task with 2 FSDP2 ranks. Usage: bash examples/sft/arith/run_arith_sft.sh [NPROC] [key=value ...]
set -euo pipefail
nproc=${1:-2}
shift || true
data_dir=${DATA_DIR:-$HOME/data/arith}
model_dir=${MODEL_DIR:-$HOME/models/tiny-init}
save_dir=${SAVE_DIR:-checkpoints/arith-sft/tiny}

[ -f "$data_dir/train.parquet" ] || python examples/data_preprocess/arith.py --local_dir "$data_dir"
[ -f "$model_dir/config.json" ] || python -m verl.models.make_tiny --preset tiny --out "$model_dir"

torchrun --standalone --nnodes=1 --nproc_per_node="$nproc" -m verl.trainer.main_sft \
    data.train_files="$data_dir/train.parquet" \
    data.val_files="$data_dir/test.parquet" \
    data.prompt_key=prompt \
    data.response_key=extra_info.answer \
    data.train_batch_size=64 \
    data.micro_batch_size_per_gpu=32 \
    data.max_length=64 \
    model.partial_pretrain="$model_dir" \
    optim.lr=1e-3 \
    optim.lr_warmup_steps_ratio=0.0 \
    optim.lr_scheduler=constant \
    trainer.default_local_dir="$save_dir" \
    trainer.total_epochs=3 \
    trainer.test_freq=20 \
    trainer.logger="['console','file']" \
    trainer.device=cpu "$@"
