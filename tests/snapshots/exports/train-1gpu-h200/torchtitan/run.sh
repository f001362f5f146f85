#!/usr/bin/env bash
# shardplan 0.1.0 export --to torchtitan: llama-3.1-8b on 1 x NVIDIA H200 (1 node(s) of 1), tp=1 pp=1 dp=1
# predicted peak per GPU: 121.82 GiB of 139.81 GiB (binding: stage 0, optimizer_states)
# keys checked against torchtitan 0.2.2 (https://github.com/pytorch/torchtitan/blob/v0.2.2/torchtitan/config/job_config.py)
# model: torchtitan's llama3 8B; tokenizer from ./assets/hf/Llama-3.1-8B (torchtitan's scripts/download_hf_assets.py --assets tokenizer)
# run: bash run.sh (with torchtitan 0.2.2 installed)
set -euo pipefail

torchrun \
    --standalone \
    --nproc-per-node 1 \
    --max-restarts 3 \
    -m torchtitan.train --job.config_file train.toml
