#!/usr/bin/env bash
# shardplan 0.1.0 export --to torchrun: llama-3.1-70b on 16 x NVIDIA H100 80GB HBM3 (2 node(s) of 8), tp=8 pp=2 dp=1
# predicted peak per GPU: 77.01 GiB of 79.11 GiB (binding: stage 0, optimizer_states)
# faults: torchrun restarts all ranks up to 3 times (--max-restarts) and re-forms the group over 2:2 nodes (--nnodes MIN:MAX; MIN: --elastic-min-nodes)
# world size changed (a node or GPU lost for good): shardplan replan plan.yaml --nodes K --lost-nodes I,J --from-checkpoint DIR -o new/plan.yaml, export new/plan.yaml, resume from the checkpoint
# run on each of the 2 nodes with HEAD_ADDR set to node 0's address (any order; c10d rendezvous assigns node ranks):
#   HEAD_ADDR=10.0.0.1 bash torchrun.sh
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
    -m shardplan verify plan.yaml
