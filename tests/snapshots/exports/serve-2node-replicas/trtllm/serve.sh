#!/usr/bin/env bash
# shardplan 0.1.0 export --to trtllm: llama-3.1-70b on 16 x NVIDIA H100 80GB HBM3 (2 node(s) of 8), tp=4 pp=1 dp=4
# predicted peak per GPU: 71.20 GiB of 79.11 GiB (binding: stage 0, kv_cache)
# flags checked against trtllm 1.0.0 (https://github.com/NVIDIA/TensorRT-LLM/blob/v1.0.0/tensorrt_llm/commands/serve.py)
# run the same script on each of the 2 nodes (each hosts 2 replica(s)); put a load balancer in front: bash serve.sh
set -euo pipefail

# replica 0: GPUs 0,1,2,3, port 8000
CUDA_VISIBLE_DEVICES=0,1,2,3 trtllm-serve meta-llama/Llama-3.1-70B \
    --backend pytorch \
    --tp_size 4 \
    --pp_size 1 \
    --max_batch_size 256 \
    --max_num_tokens 8192 \
    --max_seq_len 32768 \
    --kv_cache_free_gpu_memory_fraction 0.82 \
    --host 0.0.0.0 \
    --port 8000 \
    --extra_llm_api_options extra_llm_api_options.yaml &
# replica 1: GPUs 4,5,6,7, port 8001
CUDA_VISIBLE_DEVICES=4,5,6,7 trtllm-serve meta-llama/Llama-3.1-70B \
    --backend pytorch \
    --tp_size 4 \
    --pp_size 1 \
    --max_batch_size 256 \
    --max_num_tokens 8192 \
    --max_seq_len 32768 \
    --kv_cache_free_gpu_memory_fraction 0.82 \
    --host 0.0.0.0 \
    --port 8001 \
    --extra_llm_api_options extra_llm_api_options.yaml &
wait
