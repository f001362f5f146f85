#!/usr/bin/env bash
# shardplan 0.1.0 export --to deepspeed: llama-3.1-8b on 8 x NVIDIA H100 80GB HBM3 (1 node(s) of 8), tp=1 pp=1 dp=8
# predicted peak per GPU: 54.66 GiB of 79.11 GiB (binding: stage 0, activations)
# the plan did not count DeepSpeed's contiguous gradient bucket (reduce_bucket_size, 5e8 elements by default: 0.93 GiB in bf16 per rank, twice at stages 1-2 with overlap_comm): plan with --stack deepspeed to count it, or lower reduce_bucket_size in ds_config.json
# train.py stands for your training script: it must call deepspeed.initialize and accept --deepspeed_config (deepspeed.add_config_arguments)
set -euo pipefail

deepspeed \
    --num_nodes 1 \
    --num_gpus 8 \
    train.py --deepspeed --deepspeed_config ds_config.json
