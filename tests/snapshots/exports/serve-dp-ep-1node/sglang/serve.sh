#!/usr/bin/env bash
# shardplan 0.1.0 export --to sglang: mixtral-8x7b on 8 x NVIDIA H100 80GB HBM3 (1 node(s) of 8), tp=2 pp=1 dp=4 ep=8
# predicted peak per GPU: 71.20 GiB of 79.11 GiB (binding: stage 0, kv_cache)
# flags checked against SGLang 0.5.23 (the pinned version: the plan names no engine version; https://pypi.org/project/sglang/0.5.23/)
# --mem-fraction-static 0.87: the plan's weights + KV cache share of the GPU
# expert parallelism spans 4 replicas: they run as one server with DP attention (--attn-dp-size 4, --ep-size 8); SGLang supports DP attention for DeepSeek- and Qwen-MoE-style models
set -euo pipefail

python -m sglang.launch_server \
    --model-path mistralai/Mixtral-8x7B-v0.1 \
    --tp-size 8 \
    --pp-size 1 \
    --attn-dp-size 4 \
    --ep-size 8 \
    --dtype bfloat16 \
    --context-length 32768 \
    --mem-fraction-static 0.87 \
    --page-size 16 \
    --max-running-requests 1024 \
    --chunked-prefill-size 32768 \
    --host 0.0.0.0 \
    --port 8000
