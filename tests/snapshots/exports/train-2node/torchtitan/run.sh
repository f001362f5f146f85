#!/usr/bin/env bash
# shardplan 0.1.0 export --to torchtitan: llama-3.1-70b on 16 x NVIDIA H100 80GB HBM3 (2 node(s) of 8), tp=8 pp=2 dp=1
# predicted peak per GPU: 77.01 GiB of 79.11 GiB (binding: stage 0, optimizer_states)
# keys checked against torchtitan 0.2.2 (https://github.com/pytorch/torchtitan/blob/v0.2.2/torchtitan/config/job_config.py)
# model: torchtitan's llama3 70B; tokenizer from ./assets/hf/Llama-3.1-70B (torchtitan's scripts/download_hf_assets.py --assets tokenizer)
# run on each of the 2 nodes with HEAD_ADDR set to node 0's address:
#   HEAD_ADDR=10.0.0.1 bash run.sh
set -euo pipefail

HEAD_ADDR="${HEAD_ADDR:?set HEAD_ADDR to the address of node 0}"
RDZV_ID="${RDZV_ID:-llama-3.1-70b-7f3f6c46}"

torchrun \
    --nnodes 2:2 \
    --nproc-per-node 8 \
    --max-restarts 3 \
    --rdzv-id "$RDZV_ID" \
    --rdzv-backend c10d \
    --rdzv-endpoint "$HEAD_ADDR:29500" \
    -m torchtitan.train --job.config_file train.toml
