#!/usr/bin/env bash
# shardplan 0.1.0 export --to vllm: mixtral-8x7b on 8 x NVIDIA H100 80GB HBM3 (1 node(s) of 8), tp=2 pp=1 dp=4 ep=2
# predicted peak per GPU: 71.20 GiB of 79.11 GiB (binding: stage 0, weights)
# flags checked against vLLM 0.33.0 (the pinned version: the plan names no engine version; https://pypi.org/project/vllm/0.33.0/)
# predicted KV cache: 417,856 tokens per replica at --gpu-memory-utilization 0.90 (32768-token max_model_len)
set -euo pipefail

# replica 0: GPUs 0,1, port 8000
CUDA_VISIBLE_DEVICES=0,1 vllm serve mistralai/Mixtral-8x7B-v0.1 \
    --tensor-parallel-size 2 \
    --pipeline-parallel-size 1 \
    --enable-expert-parallel \
    --dtype bfloat16 \
    --max-model-len 32768 \
    --gpu-memory-utilization 0.90 \
    --block-size 16 \
    --kv-cache-dtype auto \
    --max-num-seqs 256 \
    --max-num-batched-tokens 8192 \
    --port 8000 &
# replica 1: GPUs 2,3, port 8001
CUDA_VISIBLE_DEVICES=2,3 vllm serve mistralai/Mixtral-8x7B-v0.1 \
    --tensor-parallel-size 2 \
    --pipeline-parallel-size 1 \
    --enable-expert-parallel \
    --dtype bfloat16 \
    --max-model-len 32768 \
    --gpu-memory-utilization 0.90 \
    --block-size 16 \
    --kv-cache-dtype auto \
    --max-num-seqs 256 \
    --max-num-batched-tokens 8192 \
    --port 8001 &
# replica 2: GPUs 4,5, port 8002
CUDA_VISIBLE_DEVICES=4,5 vllm serve mistralai/Mixtral-8x7B-v0.1 \
    --tensor-parallel-size 2 \
    --pipeline-parallel-size 1 \
    --enable-expert-parallel \
    --dtype bfloat16 \
    --max-model-len 32768 \
    --gpu-memory-utilization 0.90 \
    --block-size 16 \
    --kv-cache-dtype auto \
    --max-num-seqs 256 \
    --max-num-batched-tokens 8192 \
    --port 8002 &
# replica 3: GPUs 6,7, port 8003
CUDA_VISIBLE_DEVICES=6,7 vllm serve mistralai/Mixtral-8x7B-v0.1 \
    --tensor-parallel-size 2 \
    --pipeline-parallel-size 1 \
    --enable-expert-parallel \
    --dtype bfloat16 \
    --max-model-len 32768 \
    --gpu-memory-utilization 0.90 \
    --block-size 16 \
    --kv-cache-dtype auto \
    --max-num-seqs 256 \
    --max-num-batched-tokens 8192 \
    --port 8003 &
wait
