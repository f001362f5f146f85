#!/usr/bin/env bash
# shardplan 0.1.0 export --to trtllm: llama-3.1-8b on 1 x NVIDIA H100 80GB HBM3 (1 node(s) of 1), tp=1 pp=1 dp=1
# predicted peak per GPU: 71.20 GiB of 79.11 GiB (binding: stage 0, kv_cache)
# flags checked against trtllm 1.0.0 (https://github.com/NVIDIA/TensorRT-LLM/blob/v1.0.0/tensorrt_llm/commands/serve.py)
set -euo pipefail

trtllm-serve meta-llama/Llama-3.1-8B \
    --backend pytorch \
    --tp_size 1 \
    --pp_size 1 \
    --max_batch_size 256 \
    --max_num_tokens 8192 \
    --max_seq_len 8192 \
    --kv_cache_free_gpu_memory_fraction 0.87 \
    --host 0.0.0.0 \
    --port 8000 \
    --extra_llm_api_options extra_llm_api_options.yaml
