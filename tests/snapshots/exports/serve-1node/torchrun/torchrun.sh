#!/usr/bin/env bash
# shardplan 0.1.0 export --to torchrun: llama-3.1-70b on 8 x NVIDIA H100 80GB HBM3 (1 node(s) of 8), tp=4 pp=1 dp=2
# predicted peak per GPU: 71.20 GiB of 79.11 GiB (binding: stage 0, kv_cache)
# run on the node: bash torchrun.sh
set -euo pipefail

torchrun \
    --standalone \
    --nproc-per-node 8 \
    -m shardplan verify plan.yaml
