#!/usr/bin/env bash
# shardplan 0.1.0 export --to megatron: llama-3.2-1b on 1 x NVIDIA H100 80GB HBM3 (1 node(s) of 1), tp=1 pp=1 dp=1
# predicted peak per GPU: 22.38 GiB of 79.11 GiB (binding: stage 0, optimizer_states)
# flags checked against megatron-lm 0.19.0 (https://github.com/NVIDIA/Megatron-LM/blob/core_v0.19.0/megatron/training/arguments.py)
# MEGATRON_LM: a Megatron-LM checkout at core_v0.19.0 (pip install its requirements and transformer_engine); DATA_PATH: an indexed dataset prefix (tools/preprocess_data.py), empty: --mock-data
# run: bash pretrain.sh
set -euo pipefail

MEGATRON_LM="${MEGATRON_LM:-/opt/Megatron-LM}"
DATA_PATH="${DATA_PATH:-}"
TRAIN_ITERS="${TRAIN_ITERS:-1000}"
CHECKPOINT_DIR="${CHECKPOINT_DIR:-checkpoints}"
if [ -n "$DATA_PATH" ]; then DATA=(--data-path "$DATA_PATH" --split 99,1,0); else DATA=(--mock-data); fi

torchrun \
    --standalone \
    --nproc-per-node 1 \
    --max-restarts 3 \
    "$MEGATRON_LM/pretrain_gpt.py" \
    --tensor-model-parallel-size 1 \
    --pipeline-model-parallel-size 1 \
    --micro-batch-size 1 \
    --global-batch-size 16 \
    --seq-length 2048 \
    --bf16 \
    --num-layers 16 \
    --hidden-size 2048 \
    --ffn-hidden-size 8192 \
    --num-attention-heads 32 \
    --group-query-attention \
    --num-query-groups 8 \
    --max-position-embeddings 131072 \
    --swiglu \
    --normalization RMSNorm \
    --position-embedding-type rope \
    --rotary-base 500000 \
    --disable-bias-linear \
    --attention-dropout 0 \
    --hidden-dropout 0 \
    --tokenizer-type HuggingFaceTokenizer \
    --tokenizer-model meta-llama/Llama-3.2-1B \
    --optimizer adam \
    --lr 3e-4 \
    --clip-grad 1.0 \
    --train-iters "$TRAIN_ITERS" \
    --save "$CHECKPOINT_DIR" \
    --save-interval 500 \
    --load "$CHECKPOINT_DIR" \
    --log-interval 10 \
    "${DATA[@]}"
