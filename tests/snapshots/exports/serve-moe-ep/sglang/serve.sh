#!/usr/bin/env bash
# shardplan 0.1.0 export --to sglang: mixtral-8x7b on 8 x NVIDIA H100 80GB HBM3 (1 node(s) of 8), tp=2 pp=1 dp=4 ep=2
# predicted peak per GPU: 71.20 GiB of 79.11 GiB (binding: stage 0, weights)
# flags checked against SGLang 0.5.23 (the pinned version: the plan names no engine version; https://pypi.org/project/sglang/0.5.23/)
# --mem-fraction-static 0.87: the plan's weights + KV cache share of the GPU
set -euo pipefail

python -m sglang.launch_server \
    --model-path mistralai/Mixtral-8x7B-v0.1 \
    --tp-size 2 \
    --pp-size 1 \
    --dp-size 4 \
    --ep-size 2 \
    --dtype bfloat16 \
    --context-length 32768 \
    --mem-fraction-static 0.87 \
    --page-size 16 \
    --max-running-requests 256 \
    --chunked-prefill-size 8192 \
    --host 0.0.0.0 \
    --port 8000
