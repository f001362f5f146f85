#!/usr/bin/env bash
# shardplan 0.1.0 export --to torchtitan: llama-3.1-8b on 8 x NVIDIA H100 80GB HBM3 (1 node(s) of 8), tp=2 pp=2 dp=2
# predicted peak per GPU: 26.81 GiB of 79.11 GiB (binding: stage 0, optimizer_states)
# keys checked against torchtitan 0.2.2 (https://github.com/pytorch/torchtitan/blob/v0.2.2/torchtitan/config/job_config.py)
# model: torchtitan's llama3 8B; tokenizer from ./assets/hf/Llama-3.1-8B (torchtitan's scripts/download_hf_assets.py --assets tokenizer)
# run: bash run.sh (with torchtitan 0.2.2 installed)
set -euo pipefail

torchrun \
    --standalone \
    --nproc-per-node 8 \
    --max-restarts 3 \
    -m torchtitan.train --job.config_file train.toml
