#!/usr/bin/env bash
# shardplan 0.1.0 export --to sglang: deepseek-v3 on 16 x NVIDIA H200 (2 node(s) of 8), tp=1 pp=1 dp=16 ep=16
# predicted peak per GPU: 125.83 GiB of 139.81 GiB (binding: stage 0, weights)
# flags checked against SGLang 0.5.23 (the pinned version: the plan names no engine version; https://pypi.org/project/sglang/0.5.23/)
# --mem-fraction-static 0.88: the plan's weights + KV cache share of the GPU
# the checkpoint ships fp8 weights (its quantization_config), which SGLang loads as they are; this plan's 16-bit weights need a checkpoint in that format: point the model at one
# expert parallelism spans 16 replicas: they run as one server with DP attention (--attn-dp-size 16, --ep-size 16); SGLang supports DP attention for DeepSeek- and Qwen-MoE-style models
# each of the 1 server(s) spans 2 nodes: run on each of them with HEAD_ADDR (the server's first node) and NODE_RANK (0..1) set
set -euo pipefail

HEAD_ADDR="${HEAD_ADDR:?set HEAD_ADDR to the address of the first node of the replica}"
NODE_RANK="${NODE_RANK:?set NODE_RANK to 0..1}"

python -m sglang.launch_server \
    --model-path deepseek-ai/DeepSeek-V3 \
    --tp-size 16 \
    --pp-size 1 \
    --attn-dp-size 16 \
    --ep-size 16 \
    --nnodes 2 \
    --node-rank "$NODE_RANK" \
    --dist-init-addr "$HEAD_ADDR:20000" \
    --dtype bfloat16 \
    --context-length 8192 \
    --mem-fraction-static 0.88 \
    --page-size 16 \
    --max-running-requests 4096 \
    --chunked-prefill-size 131072 \
    --host 0.0.0.0 \
    --port 8000
