"""What the GPUs are asked to do: serve requests (vLLM semantics) or train (Megatron/ZeRO)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

from shardplan.cost.memo import hash_once
from shardplan.units import DType

if TYPE_CHECKING:
    from shardplan.cost.speculative import Speculative


ALL_LINEAR = "all-linear"  # LoRA on every decoder linear (PEFT's target_modules="all-linear")


class FineTune(str, Enum):
    FULL = "full"
    LORA = "lora"
    QLORA = "qlora"


class BaseFormat(str, Enum):
    """How the frozen base's decoder linears are stored under QLoRA."""

    NONE = "none"  # the model dtype
    NF4 = "nf4"  # bitsandbytes 4-bit NormalFloat, fp32 absmax per 64 weights
    NF4_DQ = "nf4-dq"  # with double quantization (QLoRA's recipe)


class Quantization(str, Enum):
    """Weight formats of the block's linear layers. Embeddings, lm_head, norms and routers stay
    in the model dtype, as vLLM's GPTQ/AWQ/FP8 loaders keep them."""

    NONE = "none"
    FP8 = "fp8"  # 1 byte, per-tensor scale
    INT8 = "int8"  # 1 byte, per-output-channel fp32 scale (W8A8)
    INT4 = "int4"  # GPTQ/AWQ: 4 bits, fp16 scale and 4-bit zero point per group of 128
    AWQ = "awq"
    GPTQ = "gptq"
    NF4 = "nf4"  # bitsandbytes 4-bit NormalFloat (transformers load_in_4bit): fp32 absmax per 64 weights
    # gpt-oss's checkpoint as shipped: the routed experts' weights in MXFP4 (OCP MX: 4-bit E2M1
    # values, one 8-bit E8M0 scale per 32), everything else in the dense dtype
    MXFP4 = "mxfp4"
    # The same as vLLM stores it for its Marlin kernel (GPUs without FP4 tensor cores, no triton_kernels):
    # each expert padded to an intermediate size a multiple of 128 and a hidden size a multiple of 256
    MXFP4_MARLIN = "mxfp4_marlin"
    # GGUF mixtures (llama.cpp): a ggml type per tensor by role and layer (cost/gguf.py)
    Q2_K = "q2_k"
    Q3_K_M = "q3_k_m"
    Q4_0 = "q4_0"
    Q4_K_M = "q4_k_m"
    Q5_K_M = "q5_k_m"
    Q6_K = "q6_k"
    Q8_0 = "q8_0"
    IQ4_XS = "iq4_xs"

    @property
    def is_gguf(self) -> bool:
        return self._value_ in GGUF_VALUES  # `_value_`: `value` goes through a slow descriptor

    @property
    def is_mxfp4(self) -> bool:
        """gpt-oss's MXFP4 experts, as shipped or as vLLM's Marlin kernel holds them."""
        return self._value_ in ("mxfp4", "mxfp4_marlin")


GGUF_VALUES = frozenset({"q2_k", "q3_k_m", "q4_0", "q4_k_m", "q5_k_m", "q6_k", "q8_0", "iq4_xs"})


@hash_once
@dataclass(frozen=True)
class ServingLoad:
    """The traffic a serving plan is judged under (cost/serving_load.py): requests sent at a rate
    (Poisson or evenly spaced; inf: all at once) and/or with at most `max_concurrency` in flight,
    `num_requests` of them, their lengths drawn from `lengths` (specs/lengths.py; None: every
    request input_len in, output_len out), a share of each prompt found in the prefix cache."""

    request_rate_per_second: float = float("inf")
    max_concurrency: int | None = None
    num_requests: int = 1000  # vLLM's and SGLang's benchmark clients default to 1000 prompts
    lengths: Any = None  # a LengthDistribution, or None
    lengths_name: str = "fixed"  # where the lengths come from, as printed ("fixed", "sharegpt", a file)
    prefix_cache_hit_fraction: float = 0.0
    poisson: bool = True
    seed: int = 0
    # Speculative decoding's acceptance rate: the chance each drafted token is accepted (it depends
    # on the data); with the workload's speculative setup it shapes the decode steps (cost/step_model.py).
    spec_acceptance_rate: float | None = None

    @property
    def open_loop(self) -> bool:
        """No rate and no concurrency given: each plan is judged at the most it sustains."""
        return self.max_concurrency is None and math.isinf(self.request_rate_per_second)


@hash_once
@dataclass(frozen=True)
class InferenceWorkload:
    """Serving with vLLM's memory semantics. Defaults are vLLM's."""

    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192  # tokens in one forward (the profiling pass uses this many)
    gpu_memory_utilization: float = 0.9
    block_size: int = 16  # tokens per paged KV block
    kv_cache_dtype: DType | None = None  # None ("auto"): the activation dtype
    activation_dtype: DType = DType.BF16
    quantization: Quantization = Quantization.NONE
    enforce_eager: bool = False  # no CUDA graphs
    # Performance-model inputs (time figures).
    input_len: int = 1024
    output_len: int = 128
    batch_size: int | None = None  # None: the largest that fits, up to max_num_seqs
    # Decode attention loads K/V once per query head (TensorRT-LLM <= 0.6 masked MHA, before
    # its XQA kernel); False for vLLM, SGLang and TensorRT-LLM >= 0.7, which share K/V over a GQA group.
    kv_read_per_query_head: bool = False
    # The engine and version whose rules filled the fields above (cost/engine.py resolves them
    # from knowledge/engines/*.yaml); None: the fields as given, with the switches below.
    engine: str = "vllm"
    engine_version: str | None = None
    # What the engine's budget (device memory x gpu_memory_utilization) counts, by version.
    cuda_context_in_budget: bool = False  # no baseline snapshot: the CUDA context is charged (vLLM < 0.6.5)
    cuda_graphs_in_budget: bool = True  # graphs profiled before the KV cache is sized (vLLM >= 0.21)
    refusal: str = "bytes"  # "tokens": max_model_len > cache tokens (V0); "bytes": one sequence's KV > KV memory (V1);
    # "no_room": only an empty KV pool stops the engine (SGLang)
    # "profiled": budget = device x utilization - weights - profiling peak - non-torch (vLLM);
    # "static_fraction": a pool of (device - CUDA context) x fraction holds weights and KV (SGLang)
    # "warmup" (TGI), "free_fraction" (TensorRT-LLM: fraction x the memory free after weights and activations)
    accounting: str = "profiled"
    # static_fraction without an explicit fraction: (min_tp, fraction) rows, largest min_tp first
    static_fraction_by_tp: tuple[tuple[int, float], ...] = ()
    # the same with pp > 1 where that changes it (SGLang >= 0.5.10: no prefill CUDA graphs); empty: the same
    static_fraction_by_tp_pipelined: tuple[tuple[int, float], ...] = ()
    assumptions: tuple[str, ...] = ()  # each engine rule applied, with its source, as printed
    # The host's side of a step (time_serving.host_seconds). Kernels are launched from C++ at
    # the profile's kernel_launch_us each; a Python engine also runs python_ops_per_layer framework
    # ops per decoder layer (and python_ops_per_step outside the layers) at the host's
    # python_op_us each. Decode steps of up to cuda_graph_max_batch sequences replay a CUDA
    # graph instead (0: the engine captures none).
    python_ops_per_layer: float = 0.0
    # By part where the engine's count differs by architecture (time_serving.layer_ops); empty:
    # python_ops_per_layer for every layer.
    python_ops_per_layer_parts: tuple[tuple[str, float], ...] = ()
    python_ops_per_step: float = 0.0
    cuda_graph_max_batch: int = 512
    # (from tp, batch), largest tp first, where the engine captures more at larger tensor-parallel
    # sizes (`graph_max_at`); empty: cuda_graph_max_batch at any tp.
    cuda_graph_max_batch_by_tp: tuple[tuple[int, int], ...] = ()
    step_overhead_seconds: float = 0.0  # host work per step the GPU waits for (scheduler, outputs)
    # The profiling pass's dummy sampler run: bytes per logit at its peak (the engine's default
    # sampling path). 20: V0's fp32 logits, probabilities, sort values and int64 sort indices.
    sampler_bytes_per_logit: float = 20.0
    non_torch_bytes: float | None = None  # non-torch memory beyond context and NCCL; None: the profile's
    # "warmup" (TGI): KV = share x (free after the warm-up prefill - (1 - fraction x factor) x device)
    # + the warm-up batch's own KV, which was allocated before the measurement.
    warmup_free_share: float = 1.0
    warmup_total_factor: float = 1.0
    warmup_kv_tokens: int = 0
    prefill_logit_bytes: float = 0.0  # logits the profiling prefill holds for every token (TGI)
    prefill_logit_bytes_gathered: float = 0.0  # the same with the lm_head split over tp ranks and gathered; 0: as above
    attention_workspace_bytes: float = 0.0  # TGI: the attention backend's buffer, allocated by the warm-up and kept
    # Speculative decoding (cost/speculative.py): a draft model's or the MTP layers' weights and KV on
    # the last stage, K lookahead slots per sequence; None: off.
    speculative: Speculative | None = None
    # A multimodal model's profiling pass (cost/engine.py profile_vision): the tokens its vision tower
    # runs over, on the first stage, and the encoder output rows alive while the text pass profiles.
    vision_encoder_tokens: int = 0
    vision_kept_tokens: int = 0
    # How the engine runs the layers `Layout.offload_layers` keeps off the GPU (knowledge/engines/*.yaml
    # offload_eras; cost/offload.py): "stream" copies them in every forward, "host_compute" runs them
    # on the CPU; which layers stay on the GPU ("first" or "last"); whether copies overlap compute;
    # whether the token embedding and an offloaded layer's KV stay in host memory; the prompt batch
    # from which host-resident matrix multiplications move to the GPU (0: never).
    offload_mode: str = "stream"
    offload_gpu_layers: str = "last"
    offload_overlap: bool = False
    offload_embedding_on_host: bool = False
    offload_kv_with_layer: bool = False
    offload_batch_on_gpu_min_tokens: int = 0
    offload_targets: tuple[str, ...] = ()  # where the engine can offload ("cpu", "nvme"); empty: it cannot
    offload_keeps_quantization: bool = True  # False: offloaded layers are held unquantized (transformers + bitsandbytes)
    offload_stream_unit: str = "layer"  # what one streamed copy holds on the GPU: "layer" or "tensor"
    offload_pinned: bool = True  # streamed copies come from pinned host memory (False: pageable)
    weight_formats: tuple[str, ...] = ()  # quantized formats the engine loads (searched when nothing fits otherwise)
    # The scheduler under continuous batching (knowledge/engines/*.yaml `schedule`; cost/serving_load.py):
    # "mixed" (decodes and prompt chunks in one step), "prefill_first" (prompt steps whenever a request
    # is admitted) or "static" (one batch to its end); whether prompts are chunked to the token budget;
    # whether steps with prompt tokens replay CUDA graphs; the admission reserve (initial ratio, floor
    # factor, decay steps, output clip in tokens) or None.
    chunked_prefill: bool = True
    schedule: str = "mixed"
    graphs_for_prompt_steps: bool = False
    admission: tuple[float, float, int, int] | None = None
    admit_after_preemption: bool = True  # False: a step that preempted admits no waiting request (vLLM V1)
    # 2: the next step's batch is formed while the current step runs (SGLang's overlap scheduler, vLLM's
    # async scheduling), so a request that arrives during a step waits for the one already formed too.
    batches_in_flight: int = 1
    batches_in_flight_pp1_only: bool = False  # vLLM: pipeline parallelism turns async scheduling off
    # vLLM V1's hybrid KV cache manager (knowledge/engines/vllm.yaml hybrid_kv_cache; cost/memory_serving.py):
    # sliding-window layers hold only their window's blocks per request; and what the logged
    # "GPU KV cache size" counts: "blocks" (blocks per KV cache group x block_size) or "concurrency"
    # (max concurrency x max_model_len, vLLM >= 0.20.1); and how many batches of max_num_batched_tokens a
    # sliding-window group holds per request beyond its window (2 from vLLM 0.26: async scheduling's
    # two batches in flight, VllmConfig.max_in_flight_tokens).
    hybrid_kv_cache: bool = False
    kv_tokens_reported: str = "blocks"
    # False: the engine gives each tensor-parallel rank whole KV heads of its own, so tp must divide
    # them (TGI); True: it copies KV heads where tp exceeds them (knowledge/engines/*.yaml kv_heads_copied).
    kv_heads_copied: bool = True
    # False: the engine refuses speculative decoding with pipeline parallelism (SGLang;
    # knowledge/engines/*.yaml speculative_with_pp).
    speculative_with_pp: bool = True
    # GPU architectures with FP8 tensor cores on which the engine still runs FP8 weights through Marlin
    # (TGI on Ada; knowledge/engines/*.yaml fp8_marlin); on GPUs without them every engine does.
    fp8_marlin_architectures: tuple[str, ...] = ()
    sliding_window_in_flight_batches: int = 1
    load: ServingLoad | None = None  # traffic to judge the plan under (continuous batching); None: static batch only

    def graph_max_at(self, tp: int) -> int:
        """The largest decode batch that replays a CUDA graph on a replica of tensor-parallel size `tp`."""
        for min_tp, batch in self.cuda_graph_max_batch_by_tp:
            if tp >= min_tp:
                return batch
        return self.cuda_graph_max_batch


class Optimizer(str, Enum):
    ADAMW = "adamw"  # fp32 master weights, m, v: 12 bytes/param (ZeRO paper's K = 12)
    ADAM = "adam"
    SGD = "sgd"  # fp32 master weights and momentum: 8 bytes/param
    # bitsandbytes 8-bit AdamW: both moments as uint8 in blocks of 256 with an fp32 absmax each
    # (Dettmers et al. 2022, "8-bit Optimizers via Block-wise Quantization", Sec. 2)
    ADAMW_8BIT = "adamw8bit"


class Framework(str, Enum):
    """Whose bookkeeping of model states to follow.

    zero:      the ZeRO paper (Rajbhandari et al. 2020, Sec. 3.1 and 5): 2-byte weights and
               gradients, K bytes of optimizer state, partitioned by stage.
    deepspeed: DeepSpeed's own estimators (`estimate_zero2_model_states_mem_needs`,
               `estimate_zero3_model_states_mem_needs`): an fp32 gradient partition joins the
               optimizer state (K + 4), and stage 1/2 keep the full 16-bit gradients on the GPU.
    megatron:  Megatron-Core: fp32 main gradients (4 bytes) accumulated in a contiguous buffer,
               the distributed optimizer sharding master weights and Adam states (zero_stage 1).
    """

    ZERO = "zero"
    DEEPSPEED = "deepspeed"
    MEGATRON = "megatron"


@hash_once
@dataclass(frozen=True)
class TrainingWorkload:
    seq_len: int = 4096
    global_batch_size: int = 512  # sequences per optimizer step
    optimizer: Optimizer = Optimizer.ADAMW
    framework: Framework = Framework.ZERO
    param_dtype: DType = DType.BF16
    activation_dtype: DType = DType.BF16
    flash_attention: bool = True  # no s^2 score tensor is stored (Dao et al. 2022)
    dropout: bool = False  # Korthikanti's 1-byte dropout masks (GPT-3 era models trained with dropout)
    loss_fp32_logits: bool = True  # the cross-entropy works on fp32 logits of the last stage
    # The data-parallel gradient reduction overlaps the backward (PyTorch DDP, FSDP, DeepSpeed
    # overlap_comm, Megatron-Core --overlap-grad-reduce); False: it runs after the backward.
    overlap_grad_reduce: bool = True
    # The training stack (knowledge/stacks/*.yaml) these come from; None: the fields as given.
    stack: str | None = None
    # Bytes per logit the loss head holds at its peak (the start of backward); None: 4 (or the
    # activation dtype's) once, the fp32 logits alone.
    loss_bytes_per_logit: float | None = None
    loss_vocab_parallel: bool = True  # logits stay split over tensor-parallel ranks
    loss_parallel_bytes_per_logit: float | None = None  # the vocab-parallel loss's own bytes per local logit (tp > 1)
    # The loss head's largest single tensor (bytes per logit): the caching allocator must find
    # a fresh block of that size at the peak, so it is headroom "fits" needs. 0: not checked.
    largest_allocation_bytes_per_logit: float = 0.0
    selective_policy: str = "attention_core"  # or "op_level" (PyTorch selective activation checkpointing)
    recompute_offered: tuple[str, ...] = ("none", "selective", "full")  # what the stack can checkpoint
    amp_fp32_master: bool = False  # fp32 weights under bf16 autocast: cached bf16 copies saved for backward
    norms_fp32: bool = False  # norms upcast to fp32 and save the fp32 copy
    # Unfused attention keeps the softmax's output in fp32 (saved by its backward) beside the 16-bit copy
    # the product with V reads: transformers' eager attention in most families, and every family under
    # CUDA autocast (knowledge/model_support.py hf_eager_softmax_fp32).
    eager_softmax_fp32: bool = False
    # ZeRO's contiguous gradient bucket (DeepSpeed reduce_bucket_size, elements): 0 for stacks that keep none.
    zero_reduce_bucket_elements: int = 0
    # The gradients are None at the start of a step (zero_grad(set_to_none=True)): with one micro-batch
    # a step allocates them in backward as it frees the activations.
    grads_allocated_in_backward: bool = False
    # torch's DDP (ZeRO 0 over data-parallel ranks) keeps a bucket copy of every gradient.
    ddp_gradient_buckets: bool = False
    elementwise_fused: bool = True  # norms, RoPE and SwiGLU as fused kernels (TE, or torch.compile)
    # Time per stack (knowledge/stacks/*.yaml). The fused attention kernels the stack runs, in
    # its order of preference: the first the GPU profile has a measurement for sets the
    # attention core's forward and backward efficiency; (): the profile's `attention` efficiency.
    attention_kernels: tuple[str, ...] = ()
    # Forward memory traffic of the elementwise ops when they run eager (elementwise_fused
    # False), bytes per element at 16-bit activations and kernels: a norm per hidden element,
    # rotary embedding per rotated element of q and k (each), the MLP activation per
    # intermediate element. Fused, a norm reads and writes once (4), RoPE too (4), SwiGLU reads
    # two inputs and writes one (6), one kernel each.
    norm_bytes_per_element: float = 4.0
    norm_kernels: int = 1
    rope_bytes_per_element: float = 4.0
    rope_kernels: int = 1
    act_bytes_per_element: float = 6.0
    act_kernels: int = 1
    # Unfused (eager) attention: memory traffic per score element in forward, at 16-bit
    # activations, dropout included (a dropout adds 5: reads 2, writes 2, a 1-byte mask). 13:
    # Megatron's fused scale-mask-softmax (QK^T writes 2, softmax reads and writes 4, AV reads 2).
    eager_attention_bytes_per_score: float = 13.0
    # The loss head's memory traffic (upcast, log-softmax, its gradient, the downcast), bytes
    # per logit in forward and in backward; 0: not timed.
    loss_forward_bytes_per_logit: float = 0.0
    loss_backward_bytes_per_logit: float = 0.0
    # fp8: the decoder layers' linear GEMMs run in fp8 with dynamic scaling (torchao
    # Float8Linear, Transformer Engine); activations, attention and the output layer stay 16-bit.
    matmul_dtype: DType = DType.BF16
    # With pipeline parallelism FSDP keeps each stage's parameters unsharded and accumulates
    # unsharded fp32 gradients over the micro-batches (torchtitan with torch.distributed.pipelining).
    fsdp_unsharded_under_pp: bool = False
    pp_holds_stage_outputs: bool = False  # torch.distributed.pipelining keeps each in-flight micro-batch's output
    # Tensor-parallel collectives run beside the GEMMs they feed (Transformer Engine's userbuffers
    # with Megatron's --tp-comm-overlap): only what the GEMMs cannot hide
    # is exposed. Pipeline sends overlap compute under the interleaved schedule (Megatron's
    # overlap_p2p_comm, on by default there).
    tp_comm_overlap: bool = False
    pp_p2p_overlap: bool = False
    # The stack's collectives across nodes reach all the NICs of the group's ranks in a node
    # (cost/comm.py link_for); False: each rank's own NIC (DeepSpeed ZeRO-3 as measured in 2021).
    collectives_multirail: bool = False
    # Fine-tuning (cost/finetune.py): "full" trains every weight; "lora" and "qlora" freeze the
    # base (its decoder linears stored as `base_format` under qlora) and train rank-`lora_rank`
    # adapters on `lora_targets` (module names, or "all-linear"), with PEFT's `lora_dropout`.
    finetune: FineTune = FineTune.FULL
    lora_rank: int = 16
    lora_alpha: float = 32.0
    lora_targets: tuple[str, ...] = (ALL_LINEAR,)
    lora_dropout: float = 0.0
    base_format: BaseFormat = BaseFormat.NONE
    # The stack casts the base's non-quantized parameters (embeddings, norms, lm_head) to fp32
    # under qlora (PEFT prepare_model_for_kbit_training).
    base_fp32_non_quantized: bool = False
    # Optimizer states in CUDA unified memory (bitsandbytes paged optimizers): outside PyTorch's
    # allocator, paged out to the host under memory pressure.
    paged_optimizer: bool = False
    # The optimizer's own copies: its master weights (with the gradient partition DeepSpeed
    # accumulates into) and Adam's moments. bf16: DeepSpeed's bf16_master_weights_and_grads and
    # bf16_optimizer_states (PR #7700), Megatron's precision-aware optimizer --exp-avg(-sq)-dtype.
    master_dtype: DType = DType.FP32
    moment_dtype: DType = DType.FP32
    # Megatron-Core's main-gradient buffers (grad_reduce_in_fp32 under bf16, its default; bf16 with
    # --grad-reduce-in-bf16): what each parameter's gradient takes and what data parallelism reduces
    grad_reduce_dtype: DType = DType.FP32
    # torch's foreach AdamW: its step holds one more list the size of the stepped parameters
    optimizer_foreach: bool = False
    # An MoE layer keeps its routed experts' outputs for the router probabilities' gradient (HF,
    # Megatron-Core before 0.13); False: the probabilities multiply inside the experts' activation.
    moe_expert_outputs_saved: bool = True
    # Under fp8 GEMMs each linear saves its input's fp8 copy (Transformer Engine); False: the 16-bit input.
    fp8_saves_quantized_inputs: bool = False
    # What selective recomputation recomputes (Megatron-Core --recompute-modules, knowledge/stacks/
    # megatron.yaml); (): the stack's selective policy alone (the attention core, or op-level).
    recompute_modules: tuple[str, ...] = ()

    @property
    def trains_base(self) -> bool:
        return self.finetune is FineTune.FULL
