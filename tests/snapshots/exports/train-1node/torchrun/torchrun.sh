#!/usr/bin/env bash
# shardplan 0.1.0 export --to torchrun: llama-3.1-8b on 8 x NVIDIA H100 80GB HBM3 (1 node(s) of 8), tp=1 pp=1 dp=8
# predicted peak per GPU: 54.66 GiB of 79.11 GiB (binding: stage 0, activations)
# faults: torchrun restarts all ranks up to 3 times (--max-restarts)
# world size changed (a node or GPU lost for good): shardplan replan plan.yaml --gpus N --lost-ranks R,S --from-checkpoint DIR -o new/plan.yaml, export new/plan.yaml, resume from the checkpoint
# run on the node: bash torchrun.sh
set -euo pipefail

torchrun \
    --standalone \
    --nproc-per-node 8 \
    --max-restarts 3 \
    -m shardplan verify plan.yaml
