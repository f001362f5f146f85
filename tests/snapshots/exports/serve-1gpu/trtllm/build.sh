#!/usr/bin/env bash
# shardplan 0.1.0 export --to trtllm: llama-3.1-8b on 1 x NVIDIA H100 80GB HBM3 (1 node(s) of 1), tp=1 pp=1 dp=1
# predicted peak per GPU: 71.20 GiB of 79.11 GiB (binding: stage 0, kv_cache)
# flags checked against trtllm 1.0.0 (https://github.com/NVIDIA/TensorRT-LLM/blob/v1.0.0/tensorrt_llm/commands/build.py)
# the TensorRT-engine path (serve.sh runs the PyTorch backend and needs no build)
set -euo pipefail

python examples/models/core/llama/convert_checkpoint.py \
    --model_dir meta-llama/Llama-3.1-8B \
    --output_dir ckpt \
    --dtype bfloat16 \
    --tp_size 1 \
    --pp_size 1

trtllm-build \
    --checkpoint_dir ckpt \
    --output_dir engine \
    --gemm_plugin auto \
    --max_batch_size 256 \
    --max_input_len 8191 \
    --max_seq_len 8192 \
    --max_num_tokens 8192 \
    --tokens_per_block 16

# then serve the engine: trtllm-serve engine --backend tensorrt (with the serve.sh limits)
