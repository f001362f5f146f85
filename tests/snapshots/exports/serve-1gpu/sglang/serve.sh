#!/usr/bin/env bash
# shardplan 0.1.0 export --to sglang: llama-3.1-8b on 1 x NVIDIA H100 80GB HBM3 (1 node(s) of 1), tp=1 pp=1 dp=1
# predicted peak per GPU: 71.20 GiB of 79.11 GiB (binding: stage 0, kv_cache)
# flags checked against SGLang 0.5.23 (the pinned version: the plan names no engine version; https://pypi.org/project/sglang/0.5.23/)
# --mem-fraction-static 0.88: the plan's weights + KV cache share of the GPU
set -euo pipefail

python -m sglang.launch_server \
    --model-path meta-llama/Llama-3.1-8B \
    --tp-size 1 \
    --pp-size 1 \
    --dtype bfloat16 \
    --context-length 8192 \
    --mem-fraction-static 0.88 \
    --page-size 16 \
    --max-running-requests 256 \
    --chunked-prefill-size 8192 \
    --host 0.0.0.0 \
    --port 8000
