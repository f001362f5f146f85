#!/usr/bin/env bash
# shardplan 0.1.0 export --to deepspeed: llama-3.2-1b on 1 x NVIDIA H100 80GB HBM3 (1 node(s) of 1), tp=1 pp=1 dp=1
# predicted peak per GPU: 22.38 GiB of 79.11 GiB (binding: stage 0, optimizer_states)
# train.py stands for your training script: it must call deepspeed.initialize and accept --deepspeed_config (deepspeed.add_config_arguments)
set -euo pipefail

deepspeed \
    --num_nodes 1 \
    --num_gpus 1 \
    train.py --deepspeed --deepspeed_config ds_config.json
