#!/usr/bin/env bash
# shardplan 0.1.0 export --to vllm: llama-3.1-70b on 16 x NVIDIA H100 80GB HBM3 (2 node(s) of 8), tp=4 pp=1 dp=4
# predicted peak per GPU: 71.20 GiB of 79.11 GiB (binding: stage 0, kv_cache)
# flags checked against vLLM 0.33.0 (the pinned version: the plan names no engine version; https://pypi.org/project/vllm/0.33.0/)
# predicted KV cache: 480,176 tokens per replica at --gpu-memory-utilization 0.90 (32768-token max_model_len)
# run the same script on each of the 2 nodes (each hosts 2 replica(s)); put a load balancer in front: bash serve.sh
set -euo pipefail

vllm serve meta-llama/Llama-3.1-70B \
    --tensor-parallel-size 4 \
    --pipeline-parallel-size 1 \
    --data-parallel-size 2 \
    --dtype bfloat16 \
    --max-model-len 32768 \
    --gpu-memory-utilization 0.90 \
    --block-size 16 \
    --kv-cache-dtype auto \
    --max-num-seqs 256 \
    --max-num-batched-tokens 8192 \
    --port 8000
