#!/usr/bin/env bash
# shardplan 0.1.0 export --to vllm: llama-3.1-8b on 1 x NVIDIA H100 80GB HBM3 (1 node(s) of 1), tp=1 pp=1 dp=1
# predicted peak per GPU: 71.20 GiB of 79.11 GiB (binding: stage 0, kv_cache)
# flags checked against vLLM 0.33.0 (the pinned version: the plan names no engine version; https://pypi.org/project/vllm/0.33.0/)
# predicted KV cache: 449,296 tokens per replica at --gpu-memory-utilization 0.90 (8192-token max_model_len)
set -euo pipefail

vllm serve meta-llama/Llama-3.1-8B \
    --tensor-parallel-size 1 \
    --pipeline-parallel-size 1 \
    --dtype bfloat16 \
    --max-model-len 8192 \
    --gpu-memory-utilization 0.90 \
    --block-size 16 \
    --kv-cache-dtype auto \
    --max-num-seqs 256 \
    --max-num-batched-tokens 8192 \
    --port 8000
