#!/usr/bin/env bash
# shardplan 0.1.0 export --to vllm: deepseek-v3 on 16 x NVIDIA H200 (2 node(s) of 8), tp=1 pp=1 dp=16 ep=16
# predicted peak per GPU: 125.83 GiB of 139.81 GiB (binding: stage 0, weights)
# flags checked against vLLM 0.33.0 (the pinned version: the plan names no engine version; https://pypi.org/project/vllm/0.33.0/)
# predicted KV cache: 237,680 tokens per replica at --gpu-memory-utilization 0.90 (8192-token max_model_len)
# the checkpoint ships fp8 weights (its quantization_config), which vLLM loads as they are; this plan's 16-bit weights need a checkpoint in that format: point the model at one
# expert parallelism spans 16 replicas: they run as one vLLM server, --data-parallel-size 16 --enable-expert-parallel (ep = tp x dp = 16)
# each of the 1 server(s) spans 2 nodes: run serve.sh on each of them with HEAD_ADDR (the first node) and NODE_RANK (0..1) set; node 0 serves the API
# or apply lws.yaml (LeaderWorkerSet) on Kubernetes
set -euo pipefail

HEAD_ADDR="${HEAD_ADDR:?set HEAD_ADDR to the address of the first node of the server}"
NODE_RANK="${NODE_RANK:?set NODE_RANK to 0..1}"

if [ "$NODE_RANK" = 0 ]; then
vllm serve deepseek-ai/DeepSeek-V3 \
    --tensor-parallel-size 1 \
    --pipeline-parallel-size 1 \
    --data-parallel-size 16 \
    --data-parallel-size-local 8 \
    --data-parallel-address "$HEAD_ADDR" \
    --data-parallel-rpc-port 13345 \
    --enable-expert-parallel \
    --dtype bfloat16 \
    --max-model-len 8192 \
    --gpu-memory-utilization 0.90 \
    --block-size 16 \
    --kv-cache-dtype auto \
    --max-num-seqs 256 \
    --max-num-batched-tokens 8192 \
    --port 8000
else
vllm serve deepseek-ai/DeepSeek-V3 \
    --tensor-parallel-size 1 \
    --pipeline-parallel-size 1 \
    --data-parallel-size 16 \
    --headless \
    --data-parallel-start-rank "$(($NODE_RANK * 8))" \
    --data-parallel-size-local 8 \
    --data-parallel-address "$HEAD_ADDR" \
    --data-parallel-rpc-port 13345 \
    --enable-expert-parallel \
    --dtype bfloat16 \
    --max-model-len 8192 \
    --gpu-memory-utilization 0.90 \
    --block-size 16 \
    --kv-cache-dtype auto \
    --max-num-seqs 256 \
    --max-num-batched-tokens 8192 \
    --port 8000
fi
