#!/usr/bin/env bash
# shardplan 0.1.0 export --to sglang: llama-3.1-405b on 16 x NVIDIA H100 80GB HBM3 (2 node(s) of 8), tp=8 pp=2 dp=1
# predicted peak per GPU: 71.20 GiB of 79.11 GiB (binding: stage 1, weights)
# flags checked against SGLang 0.5.23 (the pinned version: the plan names no engine version; https://pypi.org/project/sglang/0.5.23/)
# --mem-fraction-static 0.87: the plan's weights + KV cache share of the GPU
# each of the 1 server(s) spans 2 nodes: run on each of them with HEAD_ADDR (the server's first node) and NODE_RANK (0..1) set
set -euo pipefail

HEAD_ADDR="${HEAD_ADDR:?set HEAD_ADDR to the address of the first node of the replica}"
NODE_RANK="${NODE_RANK:?set NODE_RANK to 0..1}"

python -m sglang.launch_server \
    --model-path meta-llama/Llama-3.1-405B \
    --tp-size 8 \
    --pp-size 2 \
    --nnodes 2 \
    --node-rank "$NODE_RANK" \
    --dist-init-addr "$HEAD_ADDR:20000" \
    --dtype bfloat16 \
    --context-length 8192 \
    --mem-fraction-static 0.87 \
    --page-size 16 \
    --max-running-requests 256 \
    --chunked-prefill-size 8192 \
    --host 0.0.0.0 \
    --port 8000
