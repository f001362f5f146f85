#!/usr/bin/env bash
# shardplan 0.1.0 export --to accelerate: llama-3.1-70b on 16 x NVIDIA H100 80GB HBM3 (2 node(s) of 8), tp=8 pp=1 dp=2
# predicted peak per GPU: 77.67 GiB of 79.11 GiB (binding: stage 0, optimizer_states)
# run on each of the 2 nodes: HEAD_ADDR=<node 0> NODE_RANK=<i> bash launch.sh
# the plan assumes sequence parallelism over the tp ranks (accelerate's tp plan applies it)
set -euo pipefail

HEAD_ADDR="${HEAD_ADDR:?set HEAD_ADDR to the address of node 0}"
NODE_RANK="${NODE_RANK:?set NODE_RANK to the index of this node, 0..1}"

accelerate launch \
    --config_file accelerate_fsdp.yaml \
    --machine_rank "$NODE_RANK" \
    --main_process_ip "$HEAD_ADDR" \
    train.py
