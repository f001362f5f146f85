#!/usr/bin/env bash
# shardplan 0.1.0 export --to megatron: llama-3.1-70b on 16 x NVIDIA H100 80GB HBM3 (2 node(s) of 8), tp=8 pp=2 dp=1
# predicted peak per GPU: 77.01 GiB of 79.11 GiB (binding: stage 0, optimizer_states)
# flags checked against megatron-lm 0.19.0 (https://github.com/NVIDIA/Megatron-LM/blob/core_v0.19.0/megatron/training/arguments.py)
# MEGATRON_LM: a Megatron-LM checkout at core_v0.19.0 (pip install its requirements and transformer_engine); DATA_PATH: an indexed dataset prefix (tools/preprocess_data.py), empty: --mock-data
# run on each of the 2 nodes with HEAD_ADDR set to node 0's address:
#   HEAD_ADDR=10.0.0.1 bash pretrain.sh
set -euo pipefail

MEGATRON_LM="${MEGATRON_LM:-/opt/Megatron-LM}"
DATA_PATH="${DATA_PATH:-}"
TRAIN_ITERS="${TRAIN_ITERS:-1000}"
CHECKPOINT_DIR="${CHECKPOINT_DIR:-checkpoints}"
export CUDA_DEVICE_MAX_CONNECTIONS=1  # tensor/context parallel kernels issue in order
HEAD_ADDR="${HEAD_ADDR:?set HEAD_ADDR to the address of node 0}"
RDZV_ID="${RDZV_ID:-llama-3.1-70b-7f3f6c46}"
if [ -n "$DATA_PATH" ]; then DATA=(--data-path "$DATA_PATH" --split 99,1,0); else DATA=(--mock-data); fi

torchrun \
    --nnodes 2:2 \
    --nproc-per-node 8 \
    --max-restarts 3 \
    --rdzv-id "$RDZV_ID" \
    --rdzv-backend c10d \
    --rdzv-endpoint "$HEAD_ADDR:29500" \
    "$MEGATRON_LM/pretrain_gpt.py" \
    --tensor-model-parallel-size 8 \
    --pipeline-model-parallel-size 2 \
    --sequence-parallel \
    --recompute-granularity selective \
    --micro-batch-size 1 \
    --global-batch-size 64 \
    --seq-length 4096 \
    --bf16 \
    --num-layers 80 \
    --hidden-size 8192 \
    --ffn-hidden-size 28672 \
    --num-attention-heads 64 \
    --group-query-attention \
    --num-query-groups 8 \
    --max-position-embeddings 131072 \
    --swiglu \
    --normalization RMSNorm \
    --position-embedding-type rope \
    --rotary-base 500000 \
    --disable-bias-linear \
    --untie-embeddings-and-output-weights \
    --attention-dropout 0 \
    --hidden-dropout 0 \
    --tokenizer-type HuggingFaceTokenizer \
    --tokenizer-model meta-llama/Llama-3.1-70B \
    --optimizer adam \
    --lr 3e-4 \
    --clip-grad 1.0 \
    --train-iters "$TRAIN_ITERS" \
    --save "$CHECKPOINT_DIR" \
    --save-interval 500 \
    --load "$CHECKPOINT_DIR" \
    --log-interval 10 \
    "${DATA[@]}"
