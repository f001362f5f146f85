"""Options shared by several commands, declared once: choice enums, help panels and
`Annotated` aliases."""

from __future__ import annotations

import difflib
from enum import Enum
from pathlib import Path
from typing import Annotated, Callable, Optional

import typer

from shardplan.cost.workload import Framework, Optimizer, Quantization
from shardplan.errors import ShardplanError


class WorkloadKind(str, Enum):
    INFERENCE = "inference"
    TRAINING = "training"


class OffloadChoice(str, Enum):
    NONE = "none"
    OPTIMIZER_CPU = "optimizer-cpu"
    OPTIMIZER_NVME = "optimizer-nvme"
    ALL_CPU = "all-cpu"
    ALL_NVME = "all-nvme"


LAYOUT = "Layout (a degree of 1 means not used)"
SERVE = "Inference workload (the engine's semantics and defaults, by version)"
TRAIN = "Training workload"
CLUSTER = "Model and cluster"
SEARCH = "Search and goal"
PIN = "Pinned degrees (given: fixed; left out: searched)"

# Options shared by estimate and recommend, declared once.
ModelOpt = Annotated[str, typer.Argument(help="Bundled name, config.json, directory, YAML spec, or Hugging Face Hub id org/name or org/name@revision (e.g. meta-llama/Llama-3.1-8B; the local cache first, HF_HUB_OFFLINE honoured).")]
HardwareOpt = Annotated[str, typer.Option("--hardware", "-H", help="Bundled profile name or YAML.", rich_help_panel=CLUSTER)]
GpusOpt = Annotated[Optional[int], typer.Option(min=1, help="GPUs in the plan (default: one node).", rich_help_panel=CLUSTER)]
NodesOpt = Annotated[Optional[int], typer.Option(min=1, help="Nodes (default: as many as --gpus needs).", rich_help_panel=CLUSTER)]
GpusPerNodeOpt = Annotated[Optional[int], typer.Option(min=1, help="Override the profile's GPUs per node.", rich_help_panel=CLUSTER)]
WorkloadOpt = Annotated[WorkloadKind, typer.Option(help="What the GPUs do.", rich_help_panel=CLUSTER)]
MaxModelLenOpt = Annotated[Optional[int], typer.Option(min=1, help="Longest sequence (default: the model's context).", rich_help_panel=SERVE)]
MaxNumSeqsOpt = Annotated[Optional[int], typer.Option(min=1, help="Sequences in flight (default: the engine's, for its version and this GPU).", show_default=False, rich_help_panel=SERVE)]
MaxNumBatchedTokensOpt = Annotated[Optional[int], typer.Option(min=1, help="Tokens per forward pass (default: the engine's, for its version and this GPU).", show_default=False, rich_help_panel=SERVE)]
GpuMemoryUtilizationOpt = Annotated[Optional[float], typer.Option(help="Share of device memory the engine may use (default: the engine's, for its version and this GPU).", show_default=False, rich_help_panel=SERVE)]
BlockSizeOpt = Annotated[Optional[int], typer.Option(min=1, help="Tokens per KV block (default: the engine's, for its version and this GPU).", show_default=False, rich_help_panel=SERVE)]
KvCacheDtypeOpt = Annotated[Optional[str], typer.Option(
    help="auto, bf16, fp16, fp8; llama.cpp: q8_0, q4_0 (ggml blocks, 8.5/4.5 bits).", rich_help_panel=SERVE)]
WeightDtypeOpt = Annotated[Optional[str], typer.Option(help="bf16, fp16, fp8, int8, int4.", rich_help_panel=SERVE)]
QuantizationOpt = Annotated[Optional[Quantization], typer.Option(help="Weight quantization of the linear layers. mxfp4: gpt-oss's routed experts as the checkpoint ships them (the default for gpt-oss on vLLM 0.10.1+ and SGLang); mxfp4_marlin: the same padded as vLLM's Marlin kernel holds them (its default on GPUs without FP4 tensor cores). fp8 is the default for a block-quantized FP8 checkpoint (DeepSeek-V3/R1, Qwen3 FP8 releases) on vLLM 0.6.6+ and SGLang 0.4.1+ on GPUs with FP8 tensor cores, as those engines serve it; --weight-dtype bf16 plans a 16-bit copy.", rich_help_panel=SERVE)]
EnforceEagerOpt = Annotated[bool, typer.Option(help="No CUDA graphs: decode steps pay the host's time to issue every op of every layer (slower at small batches); graphs no longer take memory.", rich_help_panel=SERVE)]
InputLenOpt = Annotated[Optional[int], typer.Option(
    min=1, help="Prompt tokens per request, for time to first token and throughput (default: 1024; with --output-len "
                "left out too, a model whose context is shorter than 1024 + 128 tokens gets 7/8 of it, said with the answer).",
    show_default=False, rich_help_panel=SERVE)]
OutputLenOpt = Annotated[Optional[int], typer.Option(
    min=1, help="Generated tokens per request (default: 128, or an eighth of a shorter context).", show_default=False,
    rich_help_panel=SERVE)]
BatchSizeOpt = Annotated[Optional[int], typer.Option(min=1, help="Concurrent sequences for the time figures (default: as many as the KV cache holds, up to --max-num-seqs).", rich_help_panel=SERVE)]
LOAD = "Traffic (continuous batching under a request rate or concurrency)"
RequestRateOpt = Annotated[Optional[str], typer.Option("--request-rate", help="Requests per second sent to the plan, at least 1e-06 ('inf': all at once, as benchmark clients send them). With it or --concurrency, TTFT, TPOT and throughput come from a simulation of the engine's continuous batching (its scheduler, chunked prefill and KV-cache preemption, by version) and are reported as mean/p50/p90/p99 under `load`.", show_default=False, rich_help_panel=LOAD)]
ConcurrencyOpt = Annotated[Optional[int], typer.Option("--concurrency", min=1, help="Requests in flight at most (a benchmark client's --max-concurrency); alone, the clients send a new request as soon as one finishes.", show_default=False, rich_help_panel=LOAD)]
NumPromptsOpt = Annotated[int, typer.Option("--num-prompts", min=1, help="Requests simulated (spread evenly over the plan's replicas).", rich_help_panel=LOAD)]
DatasetLengthsOpt = Annotated[Optional[str], typer.Option("--dataset-lengths", help="Request lengths drawn from a dataset: 'sharegpt' (bundled: ShareGPT as vLLM's benchmark client samples it, first turns, right-skewed outputs), 'sharegpt-sarathi' (bundled: the Sarathi-Serve multi-turn trace) or a YAML/JSON file of per-request input_tokens/output_tokens lists or bins (default: every request --input-len in, --output-len out).", show_default=False, rich_help_panel=LOAD)]
PrefixCacheHitOpt = Annotated[float, typer.Option("--prefix-cache-hit", help="Share of each prompt found in the prefix cache (0 to below 1): not computed again, still held in the cache.", rich_help_panel=LOAD)]
ArrivalsOpt = Annotated[str, typer.Option("--arrivals", help="How requests are spaced at --request-rate: poisson (exponential gaps, the clients' default) or constant.", rich_help_panel=LOAD)]
SpecAcceptanceRateOpt = Annotated[Optional[float], typer.Option("--spec-acceptance-rate", help="Speculative decoding under traffic: the chance each drafted token is accepted (0 to 1, data-dependent); each decode step then verifies K + 1 positions and yields (1 - a^(K+1)) / (1 - a) tokens, plus the draft's K passes.", show_default=False, rich_help_panel=LOAD)]
SeedOpt = Annotated[int, typer.Option("--seed", help="Seed of the arrival times and the lengths drawn.", rich_help_panel=LOAD)]
SeqLenOpt = Annotated[int, typer.Option(min=1, help="Training sequence length.", rich_help_panel=TRAIN)]
GlobalBatchSizeOpt = Annotated[int, typer.Option(min=1, help="Sequences per optimizer step.", rich_help_panel=TRAIN)]
OptimizerOpt = Annotated[Optimizer, typer.Option(help="Optimizer (states in fp32).", rich_help_panel=TRAIN)]
FrameworkOpt = Annotated[Optional[Framework], typer.Option(help="Deprecated: use --stack (zero -> torchtitan, deepspeed -> deepspeed, megatron -> megatron); given with --stack, it overrides the stack's model-state bookkeeping.", show_default=False, rich_help_panel=TRAIN)]
FlashAttentionOpt = Annotated[Optional[bool], typer.Option(help="Flash attention (no s^2 scores kept); default: the stack's kernel.", show_default=False, rich_help_panel=TRAIN)]
CompileOpt = Annotated[bool, typer.Option("--compile/--no-compile", help="torch.compile fuses the elementwise ops (norms, RoPE, SwiGLU) into single-pass kernels; torchtitan and hf.", rich_help_panel=TRAIN)]
AttentionKernelOpt = Annotated[Optional[str], typer.Option(
    help="Attention kernel, overriding the stack's: fa2 (FlashAttention-2, PyTorch SDPA's flash backend), fa3, "
         "cudnn (Transformer Engine's fused attention) or eager (unfused softmax). The kernel used is printed.",
    callback=lambda v: choice("--attention-kernel", ["fa2", "fa3", "cudnn", "eager"], "attention kernel")(v),
    show_default=False, rich_help_panel=TRAIN)]
MatmulDtypeOpt = Annotated[Optional[str], typer.Option(
    help="Format of the decoder layers' GEMMs: bf16 (default) or fp8 (torchao Float8Linear / Transformer Engine, "
         "dynamic scaling; attention and the output layer stay bf16).",
    callback=lambda v: choice("--matmul-dtype", ["bf16", "fp8"], "matmul dtype")(v),
    show_default=False, rich_help_panel=TRAIN)]
TpCommOverlapOpt = Annotated[bool, typer.Option("--tp-comm-overlap/--no-tp-comm-overlap", help="Tensor-parallel collectives overlap the GEMMs they feed (Megatron --tp-comm-overlap with Transformer Engine userbuffers; --stack megatron).", rich_help_panel=TRAIN)]
DropoutOpt = Annotated[Optional[bool], typer.Option("--dropout/--no-dropout", help="Dropout masks kept for backward; default: on when the model's config sets a dropout probability (GPT-2: 0.1), transformers' defaults where it is silent.", show_default=False, rich_help_panel=TRAIN)]
FineTuneOpt = Annotated[str, typer.Option(
    help="What trains: full (every weight), lora (rank-r adapters on a frozen bf16 base, PEFT) or qlora (the base's "
         "decoder linears in 4-bit NF4, bitsandbytes). Example: --finetune qlora --lora-rank 64 --recompute full.",
    callback=lambda v: choice("--finetune", ["full", "lora", "qlora"], "fine-tuning method")(v), rich_help_panel=TRAIN)]
LoraRankOpt = Annotated[int, typer.Option(min=1, max=65536, help="LoRA rank r (adapter parameters: r x (in + out) per targeted linear).", rich_help_panel=TRAIN)]
LoraAlphaOpt = Annotated[Optional[float], typer.Option(min=0.0, help="LoRA alpha (scaling alpha / r; no effect on memory or time); default 2 x rank.", show_default=False, rich_help_panel=TRAIN)]
LoraTargetsOpt = Annotated[str, typer.Option(help="Comma-separated linear modules the adapters sit on (q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj), or all-linear.", rich_help_panel=TRAIN)]
LoraDropoutOpt = Annotated[float, typer.Option(min=0.0, max=0.99, help="PEFT lora_dropout: above 0 each adapter keeps a dropped copy of its input for backward.", rich_help_panel=TRAIN)]
QloraDoubleQuantOpt = Annotated[bool, typer.Option("--qlora-double-quant/--no-qlora-double-quant", help="QLoRA: quantize the NF4 constants too (4.127 bits a weight instead of 4.5; bnb_4bit_use_double_quant).", rich_help_panel=TRAIN)]
PagedOptimizerOpt = Annotated[bool, typer.Option("--paged-optimizer/--no-paged-optimizer", help="Optimizer states in CUDA unified memory (bitsandbytes paged optimizers): counted on the host, paged in when used.", rich_help_panel=TRAIN)]
MasterDtypeOpt = Annotated[Optional[str], typer.Option(
    help="The optimizer's master weights (and DeepSpeed's gradient partition): fp32 (default) or bf16 "
         "(DeepSpeed bf16_master_weights_and_grads; with --stack hf, pure bf16: a bf16-loaded model trained without "
         "AMP, its weights their own master). Example: --stack deepspeed --master-dtype bf16 --moment-dtype bf16.",
    show_default=False, callback=lambda v: choice("--master-dtype", ["fp32", "bf16"], "dtype")(v), rich_help_panel=TRAIN)]
MomentDtypeOpt = Annotated[Optional[str], typer.Option(
    help="Adam's moments: fp32 (default) or bf16 (DeepSpeed bf16_optimizer_states; Megatron "
         "--use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16).",
    show_default=False, callback=lambda v: choice("--moment-dtype", ["fp32", "bf16"], "dtype")(v), rich_help_panel=TRAIN)]
GradReduceDtypeOpt = Annotated[Optional[str], typer.Option(
    help="--stack megatron: the main gradients' dtype, which each parameter keeps and data parallelism reduces: "
         "fp32 (Megatron's default under --bf16) or bf16 (--grad-reduce-in-bf16, as NVIDIA's performance recipes "
         "run: half the gradients' memory and data-parallel traffic, though Megatron's fp32 optimizer copies its "
         "shard back to fp32 at the step, the whole model under ZeRO 0). Example: --stack megatron "
         "--grad-reduce-dtype bf16.",
    show_default=False, callback=lambda v: choice("--grad-reduce-dtype", ["fp32", "bf16"], "dtype")(v),
    rich_help_panel=TRAIN)]
OptimizerImplOpt = Annotated[Optional[str], typer.Option(
    help="How AdamW runs its step: foreach (torch's multi-tensor path: one more list the size of the stepped "
         "parameters at the step) or fused (one kernel, no list). Default: the stack's (hf: foreach, the Trainer's "
         "adamw_torch before torch 2.8; pass fused for adamw_torch_fused, its default from torch 2.8).",
    show_default=False, callback=lambda v: choice("--optimizer-impl", ["foreach", "fused"], "implementation")(v),
    rich_help_panel=TRAIN)]
ReduceBucketSizeOpt = Annotated[Optional[str], typer.Option(
    "--reduce-bucket-size", metavar="ELEMENTS|auto",
    help="--stack deepspeed: zero_optimization.reduce_bucket_size, the contiguous gradient bucket every rank keeps "
         "whole at ZeRO 1-3 (two at stages 1-2 with overlap_comm), in the 16-bit gradients' elements. Default "
         "DeepSpeed's 5e8 (0.93 GiB in bf16); auto = hidden_size x hidden_size, as the Hugging Face Trainer fills "
         "it in. The DeepSpeed export writes the same value. Example: --stack deepspeed --zero-stage 2 "
         "--reduce-bucket-size 2e8.", show_default=False, rich_help_panel=TRAIN)]
RecomputeModulesOpt = Annotated[Optional[str], typer.Option(
    "--recompute-modules", metavar="MODULES",
    help="--stack megatron: what --recompute selective recomputes (Megatron-Core's --recompute-modules, "
         "comma-separated): core_attn (the default), layernorm (MLA's input norm and the MoE pre-MLP norm), "
         "mla_up_proj (MLA's Q/K/V up-projections), moe_act (the experts' activation), mlp (dense MLPs), moe "
         "(whole MoE layers), shared_experts. Each keeps only its input and runs again in backward; the Megatron "
         "export passes the same list. Example: --stack megatron --recompute selective "
         "--recompute-modules core_attn,mla_up_proj,moe_act.", show_default=False, rich_help_panel=TRAIN)]
OverlapGradReduceOpt = Annotated[bool, typer.Option(help="Data-parallel gradient reduction overlaps the backward (DDP/FSDP/DeepSpeed overlap_comm).", rich_help_panel=TRAIN)]


def check_outputs(*outputs: tuple[str, Optional[Path]], folders_made: tuple[str, ...] = ()) -> None:
    """Before a command with several outputs does any work: the files its output options name
    (option, path; None: not given) are different files, each a file or none in a folder that
    exists or that the command makes (`folders_made`: `recommend -o DIR/plan.yaml --export` makes
    DIR) (`fileio.check_output_targets`); else exit 2 with nothing written."""
    from shardplan.fileio import check_output_targets

    check_output_targets(outputs, folders_made)


class ObjectiveChoice(str, Enum):
    GOODPUT = "goodput"
    LATENCY = "latency"
    THROUGHPUT = "throughput"
    COST = "cost"
    STEP_TIME = "step-time"


def choice(option: str, choices: list[str], what: str) -> Callable[[Optional[str]], Optional[str]]:
    """An option callback: the value, case-insensitive, must be one of `choices`; otherwise a
    one-line error naming the option, the closest choice and the list."""

    def check(value: Optional[str]) -> Optional[str]:
        if value is None:
            return None
        by_lower = {c.lower(): c for c in choices}
        if value.lower() in by_lower:
            return by_lower[value.lower()]
        close = difflib.get_close_matches(value.lower(), list(by_lower), n=1)
        guess = f"did you mean '{by_lower[close[0]]}'? " if close else ""
        raise ShardplanError(f"unknown {what} '{value}'", field=option,
                             hint=f"{guess}choose one of {', '.join(choices)}")

    return check


# The export targets by name (exporters.TARGETS), written out so that defining the options does not
# import the exporters (and through them the manifest schema and yaml): `shardplan --help` must be
# quick. tests/search/test_startup.py checks the two lists are the same.
TARGET_NAMES = ["vllm", "sglang", "tgi", "trtllm", "llamacpp", "deepspeed", "torchrun", "slurm", "megatron",
                "torchtitan", "accelerate", "kubernetes", "jax"]
TARGET_METAVAR = "[" + "|".join(TARGET_NAMES) + "]"
ToOpt = Annotated[str, typer.Option(
    "--to", help="The deployment tool to export for.", metavar=TARGET_METAVAR, show_default=False,
    callback=choice("--to", TARGET_NAMES, "export target"), autocompletion=lambda: TARGET_NAMES)]
ExportToOpt = Annotated[Optional[str], typer.Option(
    "--export", help="Also export the winner for this target, beside the -o manifest.", metavar=TARGET_METAVAR,
    callback=choice("--export", TARGET_NAMES, "export target"), autocompletion=lambda: TARGET_NAMES, rich_help_panel=SEARCH)]


def _engines() -> list[str]:
    from shardplan.knowledge.load import known_engines

    return known_engines()


def _stacks() -> list[str]:
    from shardplan.knowledge.load import known_stacks

    return known_stacks()


StackOpt = Annotated[Optional[str], typer.Option(
    help="Training stack whose loss head, checkpointing, AMP, attention kernel and model-state bookkeeping the "
         "memory and time follow: torchtitan (default), megatron, deepspeed or hf.",
    callback=lambda v: choice("--stack", _stacks(), "stack")(v),
    autocompletion=_stacks, show_default=False, rich_help_panel=TRAIN)]
# --framework (deprecated) -> the stack whose bookkeeping it named
FRAMEWORK_STACKS = {Framework.ZERO: "torchtitan", Framework.DEEPSPEED: "deepspeed", Framework.MEGATRON: "megatron"}


def resolve_stack(stack: str | None, framework: Framework | None) -> tuple[str, str | None]:
    """(the stack, the framework override): --stack wins; --framework alone picks its stack and
    says it is deprecated; neither: the default stack."""
    from shardplan.knowledge.load import DEFAULT_STACK

    if framework is not None:
        from shardplan.cli.render_common import err_console

        err_console.print(f"note: --framework is deprecated; use --stack {FRAMEWORK_STACKS[framework]}")
        if stack is None:
            return FRAMEWORK_STACKS[framework], framework.value
        return stack, framework.value
    return stack or DEFAULT_STACK, None


OffloadLayersOpt = Annotated[Optional[int], typer.Option(
    help="Serving: decoder layers whose weights stay off the GPU (with --offload all-cpu, the default, or all-nvme "
         "for accelerate's disk); the engine's rule decides which layers and whether they are streamed to the GPU "
         "every forward (vLLM, transformers) or run on the CPU (llama.cpp). E.g. --engine llamacpp --quantization "
         "q4_k_m --offload-layers 40.", show_default=False, rich_help_panel=SERVE)]
CpuOffloadGbOpt = Annotated[Optional[float], typer.Option(
    "--cpu-offload-gb", help="Serving: vLLM's --cpu-offload-gb, GiB of weights per GPU kept in host memory; "
                             "converted to the whole layers that hold at least that much.",
    show_default=False, rich_help_panel=SERVE)]
NGpuLayersOpt = Annotated[Optional[int], typer.Option(
    "--n-gpu-layers", "-ngl", help="Serving: llama.cpp's -ngl, decoder layers on the GPU (the rest run on the CPU).",
    show_default=False, rich_help_panel=SERVE)]
NCpuMoeOpt = Annotated[Optional[int], typer.Option(
    "--n-cpu-moe", "-ncmoe", help="Serving, mixture of experts: llama.cpp's --n-cpu-moe N, the routed experts of the "
                                  "first N layers kept in host memory and run on the CPU (attention, shared experts "
                                  "and the KV cache stay on the GPU). --engine llamacpp only.",
    show_default=False, rich_help_panel=SERVE)]
EngineOpt = Annotated[str, typer.Option(
    help="Serving engine whose rules (by version) shape memory, defaults and decode time: vllm, sglang, tgi, "
         "trtllm, llamacpp (llama-server, GGUF) or transformers (generate with accelerate's device_map). recommend "
         "without it: when vLLM has no plan at all (e.g. a 131K context on one 24 GB card), the first engine that "
         "has one answers, named on the first line.", callback=lambda v: choice("--engine", _engines(), "engine")(v),
    autocompletion=_engines, rich_help_panel=SERVE)]
EngineVersionOpt = Annotated[Optional[str], typer.Option(
    help="Engine version, X.Y[.Z] (default: the newest shardplan knows, printed with the answer).",
    show_default=False, rich_help_panel=SERVE)]
SpeculativeModelOpt = Annotated[Optional[str], typer.Option(
    help="Speculative decoding with a draft model: any MODEL shardplan loads (bundled name, config.json, Hub id), "
         "e.g. llama-3.2-1b for llama-3.1-70b; its weights and KV join the last stage's (vLLM method draft_model).",
    show_default=False, rich_help_panel=SERVE)]
SpeculativeMethodOpt = Annotated[Optional[str], typer.Option(
    help="Speculative method (vLLM's names): draft_model (with --speculative-model), mtp (the model's own "
         "multi-token-prediction layers, e.g. DeepSeek-V3's) or ngram (prompt lookup, no memory).",
    callback=lambda v: choice("--speculative-method", ["draft_model", "mtp", "ngram"], "speculative method")(v),
    show_default=False, rich_help_panel=SERVE)]
NumSpeculativeTokensOpt = Annotated[Optional[int], typer.Option(
    help="Tokens the drafter proposes per step (K; also lookahead KV slots per sequence); mtp default: its layers.",
    show_default=False, rich_help_panel=SERVE)]
LimitMmPerPromptOpt = Annotated[Optional[int], typer.Option(
    "--limit-mm-per-prompt", min=1, max=2**24,
    help="Multimodal models: images per prompt the engine's profiling pass assumes (vLLM --limit-mm-per-prompt "
         "image=N; default: the version's, 1 in V0, 999 in V1). The vision tower's pass on the largest images "
         "is counted in the activation peak.", show_default=False, rich_help_panel=SERVE)]
ChunkedPrefillOpt = Annotated[Optional[bool], typer.Option(
    "--enable-chunked-prefill/--no-enable-chunked-prefill",
    help="vLLM V0: chunked prefill on or off (default: the version's rule, e.g. on above a 32K context).",
    show_default=False, rich_help_panel=SERVE)]
OverlapSchedulingOpt = Annotated[Optional[bool], typer.Option(
    "--overlap-scheduling/--no-overlap-scheduling",
    help="Form the next step's batch while a step runs (vLLM --async-scheduling, default from 0.14 except with "
         "pp > 1; SGLang's overlap scheduler, off with --disable-overlap-schedule): a request that arrives during a "
         "step then waits for two. Default: the engine version's rule; exports pass the flag that sets it.",
    show_default=False, rich_help_panel=SERVE)]


def speculative_from_options(spec, speculative_model: str | None, speculative_method: str | None,
                             num_speculative_tokens: int | None):
    """The workload's speculative setup from the three options: the draft loaded as any MODEL is."""
    from shardplan.cost.inputs import speculative_setup
    from shardplan.specs import loading

    draft = loading.load_model(speculative_model) if speculative_model is not None else None
    return speculative_setup(spec, method=speculative_method, num_speculative_tokens=num_speculative_tokens,
                             draft=draft.spec if draft is not None else None,
                             draft_source=draft.origin if draft is not None else None,
                             draft_hf_id=draft.hf_id if draft is not None else None)
