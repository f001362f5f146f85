#!/usr/bin/env bash
# shardplan 0.1.0 export --to llamacpp: llama-3.1-8b on 1 x NVIDIA H100 80GB HBM3 (1 node(s) of 1), tp=1 pp=1 dp=1
# predicted peak per GPU: 71.20 GiB of 79.11 GiB (binding: stage 0, kv_cache)
# flags checked against llamacpp b11312 (https://github.com/ggml-org/llama.cpp/releases/tag/b11312)
# model: /models/Llama-3.1-8B-BF16.gguf is a placeholder: put the BF16 GGUF file of llama-3.1-8b there, or export again with --model-path (README.txt says how to make one)
# KV cache: 54 slot(s) x 8192 cells (max_model_len 8192, padded to 256), allocated at start
# --parallel 54, not max_num_seqs 256: the plan's KV cache holds 449,296 tokens, 54 whole max_model_len sequence(s), and llama.cpp allocates every slot up front
# warning: planned with vllm's memory rules; llama.cpp allocates its KV cache and compute buffers differently: re-plan with --engine llamacpp
set -euo pipefail

llama-server \
    --model /models/Llama-3.1-8B-BF16.gguf \
    --n-gpu-layers all \
    --ctx-size 442368 \
    --parallel 54 \
    --no-kv-unified \
    --cache-type-k bf16 \
    --cache-type-v bf16 \
    --flash-attn on \
    --ubatch-size 8192 \
    --batch-size 8192 \
    --host 0.0.0.0 \
    --port 8000
