#!/usr/bin/env bash
# shardplan 0.1.0 export --to torchrun: llama-3.2-1b on 1 x NVIDIA H100 80GB HBM3 (1 node(s) of 1), tp=1 pp=1 dp=1
# predicted peak per GPU: 22.38 GiB of 79.11 GiB (binding: stage 0, optimizer_states)
# faults: torchrun restarts all ranks up to 3 times (--max-restarts)
# world size changed (a node or GPU lost for good): shardplan replan plan.yaml --gpus N --lost-ranks R,S --from-checkpoint DIR -o new/plan.yaml, export new/plan.yaml, resume from the checkpoint
# run on the node: bash torchrun.sh
set -euo pipefail

torchrun \
    --standalone \
    --nproc-per-node 1 \
    --max-restarts 3 \
    -m shardplan verify plan.yaml
