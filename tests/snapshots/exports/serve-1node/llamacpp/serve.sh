#!/usr/bin/env bash
# shardplan 0.1.0 export --to llamacpp: llama-3.1-70b on 8 x NVIDIA H100 80GB HBM3 (1 node(s) of 8), tp=4 pp=1 dp=2
# predicted peak per GPU: 71.20 GiB of 79.11 GiB (binding: stage 0, kv_cache)
# flags checked against llamacpp b11312 (https://github.com/ggml-org/llama.cpp/releases/tag/b11312)
# model: /models/Llama-3.1-70B-BF16.gguf is a placeholder: put the BF16 GGUF file of llama-3.1-70b there, or export again with --model-path (README.txt says how to make one)
# KV cache: 14 slot(s) x 32768 cells (max_model_len 32768, padded to 256), allocated at start
# --parallel 14, not max_num_seqs 256: the plan's KV cache holds 480,176 tokens, 14 whole max_model_len sequence(s), and llama.cpp allocates every slot up front
# --split-mode row: every weight matrix is split by rows over the replica's 4 GPUs (equal --tensor-split shares) and each GPU works on every layer; a layer's KV cache sits on one of them
# warning: planned with vllm's memory rules; llama.cpp allocates its KV cache and compute buffers differently: re-plan with --engine llamacpp
set -euo pipefail

# replica 0: GPUs 0,1,2,3, port 8000
CUDA_VISIBLE_DEVICES=0,1,2,3 llama-server \
    --model /models/Llama-3.1-70B-BF16.gguf \
    --n-gpu-layers all \
    --split-mode row \
    --tensor-split 1,1,1,1 \
    --ctx-size 458752 \
    --parallel 14 \
    --no-kv-unified \
    --cache-type-k bf16 \
    --cache-type-v bf16 \
    --flash-attn on \
    --ubatch-size 8192 \
    --batch-size 8192 \
    --host 0.0.0.0 \
    --port 8000 &
# replica 1: GPUs 4,5,6,7, port 8001
CUDA_VISIBLE_DEVICES=4,5,6,7 llama-server \
    --model /models/Llama-3.1-70B-BF16.gguf \
    --n-gpu-layers all \
    --split-mode row \
    --tensor-split 1,1,1,1 \
    --ctx-size 458752 \
    --parallel 14 \
    --no-kv-unified \
    --cache-type-k bf16 \
    --cache-type-v bf16 \
    --flash-attn on \
    --ubatch-size 8192 \
    --batch-size 8192 \
    --host 0.0.0.0 \
    --port 8001 &
wait
