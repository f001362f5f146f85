#!/usr/bin/env bash
# shardplan 0.1.0 export --to vllm: llama-3.1-405b on 16 x NVIDIA H100 80GB HBM3 (2 node(s) of 8), tp=8 pp=2 dp=1
# predicted peak per GPU: 71.20 GiB of 79.11 GiB (binding: stage 1, weights)
set -euo pipefail

ray start \
    --head \
    --port 6379
