#!/usr/bin/env bash
# shardplan 0.1.0 export --to deepspeed: llama-3.1-8b on 16 x NVIDIA H100 80GB HBM3 (2 node(s) of 8), tp=1 pp=1 dp=16
# predicted peak per GPU: 41.36 GiB of 79.11 GiB (binding: stage 0, activations)
# the plan did not count DeepSpeed's contiguous gradient bucket (reduce_bucket_size, 5e8 elements by default: 0.93 GiB in bf16 per rank, twice at stages 1-2 with overlap_comm): plan with --stack deepspeed to count it, or lower reduce_bucket_size in ds_config.json
# train.py stands for your training script: it must call deepspeed.initialize and accept --deepspeed_config (deepspeed.add_config_arguments)
set -euo pipefail

HEAD_ADDR="${HEAD_ADDR:?set HEAD_ADDR to the address of the first host in ./hostfile}"

deepspeed \
    --hostfile hostfile \
    --num_nodes 2 \
    --num_gpus 8 \
    --master_addr "$HEAD_ADDR" \
    --master_port 29500 \
    train.py --deepspeed --deepspeed_config ds_config.json
