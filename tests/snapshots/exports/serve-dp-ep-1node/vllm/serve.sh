#!/usr/bin/env bash
# shardplan 0.1.0 export --to vllm: mixtral-8x7b on 8 x NVIDIA H100 80GB HBM3 (1 node(s) of 8), tp=2 pp=1 dp=4 ep=8
# predicted peak per GPU: 71.20 GiB of 79.11 GiB (binding: stage 0, kv_cache)
# flags checked against vLLM 0.33.0 (the pinned version: the plan names no engine version; https://pypi.org/project/vllm/0.33.0/)
# predicted KV cache: 933,952 tokens per replica at --gpu-memory-utilization 0.90 (32768-token max_model_len)
# expert parallelism spans 4 replicas: they run as one vLLM server, --data-parallel-size 4 --enable-expert-parallel (ep = tp x dp = 8)
set -euo pipefail

vllm serve mistralai/Mixtral-8x7B-v0.1 \
    --tensor-parallel-size 2 \
    --pipeline-parallel-size 1 \
    --data-parallel-size 4 \
    --enable-expert-parallel \
    --dtype bfloat16 \
    --max-model-len 32768 \
    --gpu-memory-utilization 0.90 \
    --block-size 16 \
    --kv-cache-dtype auto \
    --max-num-seqs 256 \
    --max-num-batched-tokens 8192 \
    --port 8000
