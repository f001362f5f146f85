#!/usr/bin/env bash
# shardplan 0.1.0 export --to tgi: llama-3.1-8b on 1 x NVIDIA H100 80GB HBM3 (1 node(s) of 1), tp=1 pp=1 dp=1
# predicted peak per GPU: 71.20 GiB of 79.11 GiB (binding: stage 0, kv_cache)
# flags checked against TGI 3.3.7 (the pinned version: the plan names no engine version; https://github.com/huggingface/text-generation-inference/blob/v3.3.7/launcher/src/main.rs)
# notice: TGI has been in maintenance mode since December 2025 (source: its README, https://github.com/huggingface/text-generation-inference, PR #3344; 3.3.7 is its newest release); consider --to vllm or sglang
set -euo pipefail

# replica 0: GPUs 0, port 8000
CUDA_VISIBLE_DEVICES=0 text-generation-launcher \
    --model-id meta-llama/Llama-3.1-8B \
    --num-shard 1 \
    --sharded false \
    --dtype bfloat16 \
    --max-input-tokens 8191 \
    --max-total-tokens 8192 \
    --max-batch-prefill-tokens 8192 \
    --max-batch-size 256 \
    --cuda-memory-fraction 0.90 \
    --port 8000 \
    --shard-uds-path /tmp/tgi-replica-0 \
    --master-port 29500 \
    --prometheus-port 9000 &
wait
