#!/usr/bin/env bash
# shardplan 0.1.0 export --to tgi: llama-3.1-70b on 8 x NVIDIA H100 80GB HBM3 (1 node(s) of 8), tp=4 pp=1 dp=2
# predicted peak per GPU: 71.20 GiB of 79.11 GiB (binding: stage 0, kv_cache)
# flags checked against TGI 3.3.7 (the pinned version: the plan names no engine version; https://github.com/huggingface/text-generation-inference/blob/v3.3.7/launcher/src/main.rs)
# notice: TGI has been in maintenance mode since December 2025 (source: its README, https://github.com/huggingface/text-generation-inference, PR #3344; 3.3.7 is its newest release); consider --to vllm or sglang
set -euo pipefail

# replica 0: GPUs 0,1,2,3, port 8000
CUDA_VISIBLE_DEVICES=0,1,2,3 text-generation-launcher \
    --model-id meta-llama/Llama-3.1-70B \
    --num-shard 4 \
    --sharded true \
    --dtype bfloat16 \
    --max-input-tokens 32767 \
    --max-total-tokens 32768 \
    --max-batch-prefill-tokens 32767 \
    --max-batch-size 256 \
    --cuda-memory-fraction 0.90 \
    --port 8000 \
    --shard-uds-path /tmp/tgi-replica-0 \
    --master-port 29500 \
    --prometheus-port 9000 &
# replica 1: GPUs 4,5,6,7, port 8001
CUDA_VISIBLE_DEVICES=4,5,6,7 text-generation-launcher \
    --model-id meta-llama/Llama-3.1-70B \
    --num-shard 4 \
    --sharded true \
    --dtype bfloat16 \
    --max-input-tokens 32767 \
    --max-total-tokens 32768 \
    --max-batch-prefill-tokens 32767 \
    --max-batch-size 256 \
    --cuda-memory-fraction 0.90 \
    --port 8001 \
    --shard-uds-path /tmp/tgi-replica-1 \
    --master-port 29501 \
    --prometheus-port 9001 &
wait
