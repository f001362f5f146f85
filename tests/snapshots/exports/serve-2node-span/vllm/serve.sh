#!/usr/bin/env bash
# shardplan 0.1.0 export --to vllm: llama-3.1-405b on 16 x NVIDIA H100 80GB HBM3 (2 node(s) of 8), tp=8 pp=2 dp=1
# predicted peak per GPU: 71.20 GiB of 79.11 GiB (binding: stage 1, weights)
# flags checked against vLLM 0.33.0 (the pinned version: the plan names no engine version; https://pypi.org/project/vllm/0.33.0/)
# predicted KV cache: 727,840 tokens per replica at --gpu-memory-utilization 0.90 (8192-token max_model_len)
# each of the 1 replica(s) spans 2 nodes and runs as its own Ray cluster:
#   1. on the replica's first node: bash ray-head.sh
#   2. on its other 1 node(s): HEAD_ADDR=<first node> bash ray-worker.sh
#   3. on the first node, once `ray status` shows every GPU: bash serve.sh
# or apply lws.yaml (LeaderWorkerSet) on Kubernetes
set -euo pipefail

vllm serve meta-llama/Llama-3.1-405B \
    --tensor-parallel-size 8 \
    --pipeline-parallel-size 2 \
    --distributed-executor-backend ray \
    --dtype bfloat16 \
    --max-model-len 8192 \
    --gpu-memory-utilization 0.90 \
    --block-size 16 \
    --kv-cache-dtype auto \
    --max-num-seqs 256 \
    --max-num-batched-tokens 8192 \
    --port 8000
