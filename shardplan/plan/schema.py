"""The manifest's schema: strict, frozen sections, and the checks that a layout read back
from a file can exist on the model and cluster it records (`manifest.py` builds, writes and
reads it).

Rank order (the one `cost.comm.layout_groups` assumes): tp fastest, then cp, dp, pp, so
rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i and node = rank // gpus_per_node; the
ranks of a pipeline stage are contiguous.
"""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, model_validator

from shardplan.cost.inputs import MAX_SEQUENCES, MAX_SPECULATIVE_TOKENS
from shardplan.cost.layout import Offload, PipelineSchedule, Recompute
from shardplan.cost.params import Split
from shardplan.cost.workload import Framework, Optimizer, Quantization
from shardplan.knowledge.schema import BandKind, BandQuantity, RecomputeModule
from shardplan.errors import ShardplanError
from shardplan.knowledge.load import engine_rules
from shardplan.specs.model import MAX_TOKENS
from shardplan.units import DType

SCHEMA_VERSION: int = 1
MESH_AXIS_ORDER = ("pp", "dp", "cp", "tp")  # outer -> inner; tp ranks are adjacent


def _values(enum: type[Enum]) -> Any:
    """A Literal of an enum's string values: the manifest holds plain strings."""
    return Literal[tuple(e.value for e in enum)]


DTypeName = _values(DType)
QuantizationName = _values(Quantization)
OffloadName = _values(Offload)
SplitName = _values(Split)
OptimizerName = _values(Optimizer)
FrameworkName = _values(Framework)
RecomputeName = _values(Recompute)
ScheduleName = _values(PipelineSchedule)
RecomputeModuleName = RecomputeModule
Degree = Annotated[int, Field(ge=1)]
Pair = Annotated[list[int], Field(min_length=2, max_length=2, description="[first, last], both inclusive")]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False, defer_build=True)


class ModelSection(_Section):
    name: str = Field(description="the model spec's name")
    source: str = Field(description="the file the spec was loaded from, as given")
    hf_id: str | None = Field(description="Hugging Face repository id, when the spec names one")
    spec_sha256: str = Field(
        pattern="^[0-9a-f]{64}$",
        description="sha256 of the spec as canonical JSON (sorted keys, no spaces), its `source` path left out",
    )
    num_params: int = Field(ge=1, description="stored parameters, embeddings and an untied lm_head included")
    num_active_params: int = Field(ge=1, description="parameters one token uses (MoE: the routed top-k experts only)")
    num_layers: int = Field(ge=1, description="transformer blocks")
    num_attention_heads: int = Field(ge=1, description="query heads")
    num_kv_heads: int = Field(ge=1, description="key/value heads (MLA models: the query heads, as vLLM splits them)")
    num_experts: int | None = Field(ge=1, description="routed experts per MoE layer; null for a dense model")


class HardwareSection(_Section):
    profile_name: str = Field(description="the hardware profile's name")
    gpu_model: str = Field(description="the GPU as the profile names it")
    num_nodes: int = Field(ge=1, description="nodes used")
    gpus_per_node: int = Field(ge=1, description="GPUs used per node")
    num_gpus: int = Field(ge=1, description="GPUs in all: num_nodes x gpus_per_node")
    memory_capacity_bytes: int = Field(ge=1, description="memory of one GPU, bytes")


class GraphBatchRow(_Section):
    """An engine's decode CUDA-graph batch from a tensor-parallel size up."""

    min_tp: int = Field(ge=1, description="applies from this tensor-parallel size up")
    batch: int = Field(ge=0, description="decode batches up to this size replay CUDA graphs")


class StaticFractionRow(_Section):
    """SGLang's default pool fraction from a tensor-parallel size up."""

    min_tp: int = Field(ge=1, description="applies from this tensor-parallel size up")
    fraction: float = Field(gt=0, le=1, description="mem_fraction_static")


class SpeculativeSection(_Section):
    """Speculative decoding (cost/speculative.py), as vLLM's --speculative-config names it."""

    method: Literal["draft_model", "mtp", "ngram"] = Field(description="draft_model, mtp (the model's own MTP layers) or ngram")
    num_speculative_tokens: int = Field(ge=1, le=MAX_SPECULATIVE_TOKENS,
                                        description="tokens proposed per step (K); lookahead slots per sequence")
    draft_model: str | None = Field(None, description="the draft model's spec name; null: none (mtp, ngram)")
    draft_source: str | None = Field(None, description="where the draft spec is read from: bundled:<name> or a path")
    draft_hf_id: str | None = Field(None, description="the draft's Hugging Face id, what the engine loads; null: unknown")


class TokenBinsSection(_Section):
    """specs.lengths.TokenBins: bin k holds the integers [min, max] with weight k."""

    min_tokens: list[int] = Field(description="each bin's first length, tokens")
    max_tokens: list[int] = Field(description="each bin's last length, tokens")
    weights: list[float] = Field(description="each bin's share of the requests (any positive scale)")


class LengthsSection(_Section):
    """specs.lengths.LengthDistribution, field for field."""

    kind: str = Field(description="fixed, uniform or histogram")
    input_bins: TokenBinsSection = Field(description="prompt lengths")
    output_bins: TokenBinsSection = Field(description="output lengths")
    paired: bool = Field(description="input bin k goes with output bin k")
    source: str = Field(description="where the lengths came from")
    max_total_tokens: int | None = Field(None, description="only requests of at most this many tokens in all")
    refused_fraction: float = Field(0.0, ge=0, le=1, description="share of requests the context limit removed")


class LoadSection(_Section):
    """`cost.workload.ServingLoad`: the traffic the plan was judged under (continuous batching)."""

    request_rate_per_second: float | None = Field(gt=0, description="requests per second; null: all at once (inf)")
    max_concurrency: int | None = Field(ge=1, le=MAX_SEQUENCES, description="requests in flight at most; null: no cap")
    num_requests: int = Field(ge=1, description="requests simulated")
    lengths: LengthsSection | None = Field(description="request lengths; null: input_len in, output_len out")
    lengths_name: str = Field(description="where the lengths came from, as printed")
    prefix_cache_hit_fraction: float = Field(ge=0, lt=1, description="share of each prompt found in the prefix cache")
    poisson: bool = Field(description="exponential gaps between requests (false: evenly spaced)")
    seed: int = Field(description="seed of the arrival times and the lengths drawn")
    spec_acceptance_rate: float | None = Field(None, gt=0, le=1, description="speculative decoding: the chance each "
                                                                          "drafted token is accepted; null: not timed")


class InferenceWorkloadSection(_Section):
    """`cost.workload.InferenceWorkload`, field for field (vLLM semantics)."""

    kind: Literal["inference"] = Field(description="serving")
    max_model_len: int | None = Field(ge=1, le=MAX_TOKENS, description="tokens of one sequence; null: the model's maximum")
    max_num_seqs: int = Field(ge=1, le=MAX_SEQUENCES, description="sequences in one batch at most")
    max_num_batched_tokens: int = Field(ge=1, le=MAX_TOKENS, description="tokens in one forward pass at most")
    gpu_memory_utilization: float = Field(gt=0, le=1, description="share of GPU memory the engine may use")
    block_size: int = Field(ge=1, le=MAX_TOKENS, description="tokens per paged KV-cache block")
    kv_cache_dtype: DTypeName | None = Field(description="KV-cache format; null: the activation dtype")
    activation_dtype: DTypeName = Field(description="activation and unquantized weight format")
    quantization: QuantizationName = Field(description="weight format of the blocks' linear layers")
    enforce_eager: bool = Field(description="true: no CUDA graphs")
    input_len: int = Field(ge=1, le=MAX_TOKENS, description="prompt tokens per request (time figures)")
    output_len: int = Field(ge=1, le=MAX_TOKENS, description="generated tokens per request (time figures)")
    batch_size: int | None = Field(ge=1, le=MAX_SEQUENCES, description="concurrent requests; null: the most that fit")
    kv_read_per_query_head: bool = Field(description="decode attention reads K/V once per query head")
    # Engine rules (knowledge/engines/*.yaml); the defaults are what plans written before them meant.
    engine: str = Field("vllm", description="the serving engine the plan was made for")
    engine_version: str | None = Field(None, description="its version; null: no version rules were applied")
    cuda_context_in_budget: bool = Field(False, description="the engine's budget counts the CUDA context")
    cuda_graphs_in_budget: bool = Field(True, description="the engine's budget counts CUDA graphs")
    refusal: Literal["tokens", "bytes", "no_room", "total_tokens"] = Field("bytes", description="how the engine refuses a max_model_len that does not fit")
    accounting: Literal["profiled", "static_fraction", "warmup", "free_fraction", "fixed_context", "dynamic"] = Field(
        "profiled", description="how the engine sizes its KV memory")
    static_fraction_by_tp: list[StaticFractionRow] = Field(default_factory=list, description="SGLang's default pool fraction by tensor-parallel size")
    static_fraction_by_tp_pipelined: list[StaticFractionRow] = Field(
        default_factory=list, description="the same with pipeline stages (pp > 1) where that differs; empty: the same")
    assumptions: list[str] = Field(default_factory=list, description="each engine rule that shaped the plan, with its source")
    python_ops_per_layer: float = Field(0.0, ge=0, description="framework ops per decoder layer the engine issues from Python in eager mode")
    python_ops_per_layer_parts: dict[str, float] = Field(
        default_factory=dict, description="eager framework ops of a decoder layer by part (norms, attention, mla_attention, "
                                          "qk_norm, dense_mlp, moe, per_fp8_block_linear, per_all_reduce); empty: "
                                          "python_ops_per_layer for every layer")
    python_ops_per_step: float = Field(0.0, ge=0, description="eager framework ops per step for the logits and the sampler")
    cuda_graph_max_batch: int = Field(512, ge=0, le=MAX_SEQUENCES, description="decode batches up to this size replay CUDA graphs; 0: none")
    cuda_graph_max_batch_by_tp: list[GraphBatchRow] = Field(
        default_factory=list, description="where the engine captures more at larger tensor-parallel sizes (SGLang from "
                                          "0.5.3 at tp >= 4): the batch from each tp up, largest first; empty: "
                                          "cuda_graph_max_batch at any tp")
    step_overhead_seconds: float = Field(0.0, ge=0, description="host work per step the GPU waits for (scheduler, outputs), s")
    sampler_bytes_per_logit: float = Field(20.0, ge=0, description="bytes per logit the profiling pass's dummy sampler holds")
    non_torch_bytes: float | None = Field(None, ge=0, description="non-torch memory beyond the CUDA context and NCCL; null: the profile's")
    warmup_free_share: float = Field(1.0, gt=0, le=1, description="TGI: the share of the free memory sized as KV")
    warmup_total_factor: float = Field(1.0, gt=0, le=1, description="TGI >= 3: the device share held back is 1 - fraction x this")
    warmup_kv_tokens: int = Field(0, ge=0, description="TGI: the warm-up batch's KV tokens, counted back")
    prefill_logit_bytes: float = Field(0.0, ge=0, description="bytes per logit the profiling prefill holds for every token")
    prefill_logit_bytes_gathered: float = Field(
        0.0, ge=0, description="the same with the lm_head split over tensor-parallel ranks and gathered; 0: as above")
    attention_workspace_bytes: float = Field(
        0.0, ge=0, description="TGI: a buffer the attention backend allocates in the warm-up and keeps, bytes")
    speculative: SpeculativeSection | None = Field(None, description="speculative decoding; null: off (plans before it)")
    vision_encoder_tokens: int = Field(0, ge=0, description="tokens the vision tower runs over in the profiling pass")
    vision_kept_tokens: int = Field(0, ge=0, description="encoder output rows alive during the text profiling pass")
    offload_mode: Literal["stream", "host_compute"] = Field(
        "stream", description="how offloaded layers run: copied to the GPU every forward, or on the CPU")
    offload_gpu_layers: Literal["first", "last"] = Field("last", description="which decoder layers stay on the GPU")
    offload_overlap: bool = Field(False, description="offloaded weights' copies overlap compute (prefetch)")
    offload_embedding_on_host: bool = Field(False, description="the token embedding stays in host memory when offloading")
    offload_kv_with_layer: bool = Field(False, description="an offloaded layer's KV cache lives in host memory")
    offload_batch_on_gpu_min_tokens: int = Field(
        0, ge=0, description="prompt batches of at least this many tokens multiply host-resident weights on the GPU")
    offload_targets: list[Literal["cpu", "nvme"]] = Field(default_factory=list, description="where the engine can offload weights")
    offload_keeps_quantization: bool = Field(True, description="offloaded layers keep the plan's weight format")
    offload_stream_unit: Literal["layer", "tensor"] = Field("layer", description="what one streamed copy holds on the GPU")
    offload_pinned: bool = Field(True, description="streamed copies come from pinned host memory (false: pageable)")
    weight_formats: list[str] = Field(default_factory=list, description="quantized weight formats the engine loads")
    chunked_prefill: bool = Field(True, description="prompts are computed in chunks of the token budget")
    schedule: Literal["mixed", "prefill_first", "static"] = Field(
        "mixed", description="how the engine composes a step under continuous batching (knowledge/engines/*.yaml)")
    graphs_for_prompt_steps: bool = Field(False, description="steps with prompt tokens replay CUDA graphs")
    admission: list[float] | None = Field(None, description="admission reserve: initial ratio, floor factor, decay steps, "
                                                            "output clip in tokens; null: none")
    admit_after_preemption: bool = Field(True, description="a step that preempted still admits waiting requests (false: vLLM V1)")
    batches_in_flight: int | None = Field(None, ge=1, le=2, description="2: the next step's batch was formed while a "
                                          "step ran (overlap or async scheduling); null: a plan written before this "
                                          "was recorded, costed with 1, exported without a flag")
    batches_in_flight_pp1_only: bool = Field(False, description="pipeline parallelism turns that off (vLLM, SGLang)")
    hybrid_kv_cache: bool = Field(False, description="sliding-window layers hold only their window's KV blocks per request "
                                                     "(vLLM V1's hybrid KV cache manager)")
    kv_tokens_reported: Literal["blocks", "concurrency"] = Field(
        "blocks", description="what the logged KV cache size counts: blocks per KV cache group x block size, or max "
                              "concurrency x max_model_len")
    kv_heads_copied: bool = Field(True, description="the engine copies KV heads where tp exceeds them (false: tp must "
                                                    "divide them, TGI)")
    speculative_with_pp: bool = Field(True, description="speculative decoding runs with pipeline parallelism (false: the "
                                                        "engine refuses the two together, SGLang)")
    fp8_marlin_architectures: list[str] = Field(default_factory=list, description="GPU architectures with FP8 tensor cores "
                                                "on which the engine still runs FP8 weights through Marlin (TGI on Ada)")
    sliding_window_in_flight_batches: int = Field(1, ge=1, description="batches of the token budget a sliding-window KV "
                                                                       "group holds per request beyond its window (2: "
                                                                       "vLLM >= 0.26 with async scheduling)")
    load: LoadSection | None = Field(None, description="the traffic the plan was judged under; null: none")


class TrainingWorkloadSection(_Section):
    """`cost.workload.TrainingWorkload`, field for field."""

    kind: Literal["training"] = Field(description="training")
    seq_len: int = Field(ge=1, description="tokens per sequence")
    global_batch_size: int = Field(ge=1, description="sequences per optimizer step")
    optimizer: OptimizerName = Field(description="optimizer whose states are kept")
    framework: FrameworkName = Field(description="whose bookkeeping of model states is followed")
    param_dtype: DTypeName = Field(description="weight and gradient format")
    activation_dtype: DTypeName = Field(description="activation format")
    flash_attention: bool = Field(description="no seq_len^2 score tensor is stored")
    dropout: bool = Field(description="dropout masks are stored")
    loss_fp32_logits: bool = Field(description="the loss works on fp32 logits")
    overlap_grad_reduce: bool = Field(description="the data-parallel gradient reduction overlaps the backward")
    # Training stack (knowledge/stacks/*.yaml); the defaults are what plans written before them meant.
    stack: str | None = Field(None, description="the training stack whose rules these follow; null: as given")
    loss_bytes_per_logit: float | None = Field(None, gt=0, description="bytes per logit the loss head holds at its peak")
    loss_vocab_parallel: bool = Field(True, description="the logits stay split over tensor-parallel ranks")
    loss_parallel_bytes_per_logit: float | None = Field(
        None, gt=0, description="with tensor parallelism, bytes per local logit of the stack's loss-parallel "
                                "cross-entropy; null: loss_bytes_per_logit")
    largest_allocation_bytes_per_logit: float = Field(0.0, ge=0, description="the loss head's largest tensor, bytes per logit")
    selective_policy: Literal["attention_core", "op_level"] = Field("attention_core", description="what selective recomputation keeps")
    recompute_offered: list[RecomputeName] = Field(default_factory=lambda: ["none", "selective", "full"], description="the checkpointing the stack offers")
    amp_fp32_master: bool = Field(False, description="fp32 weights under bf16 autocast, with cached bf16 copies")
    norms_fp32: bool = Field(False, description="norms save an fp32 copy of their input")
    eager_softmax_fp32: bool = Field(False, description="unfused attention keeps its softmax output in fp32")
    zero_reduce_bucket_elements: int = Field(0, ge=0, le=10**11, description="ZeRO's contiguous gradient bucket, "
                                                                          "elements (DeepSpeed reduce_bucket_size)")
    grads_allocated_in_backward: bool = Field(False, description="the gradients are allocated in backward as the "
                                                                 "activations are freed")
    ddp_gradient_buckets: bool = Field(False, description="DDP's reducer keeps a bucket copy of every gradient")
    elementwise_fused: bool = Field(True, description="norms, RoPE and SwiGLU run as fused kernels")
    attention_kernels: list[Literal["fa2", "fa3", "cudnn"]] = Field(
        default_factory=list, description="the stack's attention kernels in order of preference; empty: the profile's")
    norm_bytes_per_element: float = Field(4.0, gt=0, le=1000, description="eager norm traffic, bytes per element")
    norm_kernels: int = Field(1, ge=1, le=100, description="kernels of one eager norm")
    rope_bytes_per_element: float = Field(4.0, gt=0, le=1000, description="eager RoPE traffic, bytes per element")
    rope_kernels: int = Field(1, ge=1, le=100, description="kernels of the eager RoPE")
    act_bytes_per_element: float = Field(6.0, gt=0, le=1000, description="eager MLP activation traffic, bytes per element")
    act_kernels: int = Field(1, ge=1, le=100, description="kernels of the eager MLP activation")
    eager_attention_bytes_per_score: float = Field(13.0, gt=0, le=1000, description="unfused attention's traffic per score")
    loss_forward_bytes_per_logit: float = Field(0.0, ge=0, le=1000, description="the loss head's forward traffic, bytes per logit")
    loss_backward_bytes_per_logit: float = Field(0.0, ge=0, le=1000, description="its backward traffic, bytes per logit")
    matmul_dtype: DTypeName = Field("bf16", description="the linear layers' GEMM format (fp8: dynamic scaling)")
    fsdp_unsharded_under_pp: bool = Field(False, description="FSDP keeps stage parameters and gradients unsharded under pp")
    pp_holds_stage_outputs: bool = Field(False, description="the pipeline runtime keeps each in-flight micro-batch's "
                                                            "stage output until its backward")
    tp_comm_overlap: bool = Field(False, description="tensor-parallel collectives overlap the GEMMs")
    pp_p2p_overlap: bool = Field(False, description="pipeline sends overlap compute (interleaved schedule)")
    collectives_multirail: bool = Field(False, description="cross-node collectives reach all the group's NICs in a node")
    # Fine-tuning; the defaults (full fine-tuning) are what plans written before it meant.
    finetune: Literal["full", "lora", "qlora"] = Field("full", description="full: every weight trains; lora/qlora: adapters on a frozen base")
    lora_rank: int = Field(16, ge=1, le=65536, description="LoRA rank r")
    lora_alpha: float = Field(32.0, gt=0, description="LoRA alpha (scaling alpha / r)")
    lora_targets: list[str] = Field(default_factory=lambda: ["all-linear"], max_length=64, description="modules the adapters sit on")
    lora_dropout: float = Field(0.0, ge=0, lt=1, description="PEFT lora_dropout")
    base_format: Literal["none", "nf4", "nf4-dq"] = Field("none", description="storage of the frozen base's decoder linears")
    base_fp32_non_quantized: bool = Field(False, description="the base's non-quantized parameters upcast to fp32 (PEFT)")
    paged_optimizer: bool = Field(False, description="optimizer states in unified memory, paged to the host")
    master_dtype: Literal["fp32", "bf16"] = Field("fp32", description="the optimizer's master weights (and DeepSpeed's "
                                                                   "gradient partition)")
    moment_dtype: Literal["fp32", "bf16"] = Field("fp32", description="the optimizer's moments (Adam's m and v)")
    grad_reduce_dtype: Literal["fp32", "bf16"] = Field("fp32", description="Megatron-Core's main gradients, which data "
                                                                       "parallelism reduces (fp32: grad_reduce_in_fp32)")
    optimizer_foreach: bool = Field(False, description="torch's foreach AdamW: the step allocates a parameter-sized list")
    # Megatron-Core's MoE, Transformer Engine's fp8 and fine-grained recomputation; the defaults are
    # what plans written before them meant.
    moe_expert_outputs_saved: bool = Field(True, description="MoE layers keep their routed experts' outputs for the "
                                                             "router probabilities' gradient")
    fp8_saves_quantized_inputs: bool = Field(False, description="under fp8 GEMMs the linears save their inputs' fp8 copies")
    recompute_modules: list[RecomputeModuleName] = Field(
        default_factory=list, max_length=16, description="what selective recomputation recomputes (Megatron-Core "
                                                         "--recompute-modules); empty: the stack's selective policy")


class LayoutSection(_Section):
    tp: Degree = Field(description="tensor-parallel degree (1: not used)")
    pp: Degree = Field(description="pipeline stages")
    dp: Degree = Field(description="data-parallel degree; for serving, the number of replicas")
    cp: Degree = Field(description="context-parallel degree")
    ep: Degree = Field(description="expert-parallel degree, folded over dp x cp x tp ranks")
    etp: Degree = Field(description="tensor-parallel degree inside each expert")
    zero_stage: int = Field(ge=0, le=3, description="0 none, 1 optimizer states, 2 + gradients, 3 + parameters")
    hybrid_shard: bool = Field(description="ZeRO/FSDP shards within a node only (HSDP)")
    sequence_parallel: bool = Field(description="Megatron sequence parallelism over the tp ranks")
    recompute: RecomputeName = Field(description="activation recomputation")
    pp_schedule: ScheduleName = Field(description="pipeline schedule")
    virtual_stages: Degree = Field(description="model chunks per pipeline stage (interleaved schedule)")
    micro_batch_size: Degree = Field(description="sequences per micro-batch")
    offload_optimizer: OffloadName = Field(description="where optimizer states live off the GPU")
    offload_params: OffloadName = Field(description="where parameters live off the GPU")
    offload_layers: int = Field(0, ge=0, description="serving: decoder layers whose weights live at offload_params "
                                                     "(cpu: host RAM; nvme: disk) instead of the GPU")
    offload_expert_layers: int = Field(0, ge=0, description="serving, MoE: the first N decoder layers whose routed "
                                                            "experts live in host memory and run on the CPU "
                                                            "(llama.cpp --n-cpu-moe); 0: none")
    pp_embedding_as_layer: bool = Field(False, description="the embedding counts as one layer in the pipeline split")
    pp_loss_as_layer: bool = Field(False, description="the output layer and loss count as one layer in the split")
    pp_first_stage_layers: int | None = Field(None, ge=1, description="decoder layers on the first stage; null: even")
    pp_last_stage_layers: int | None = Field(None, ge=1, description="decoder layers on the last stage; null: even")
    weight_quantization: QuantizationName | None = Field(description="serving: weight format; null for training")
    kv_cache_dtype: DTypeName | None = Field(description="serving: KV-cache format, resolved; null for training")


class MeshAxis(_Section):
    axis: Literal[MESH_AXIS_ORDER] = Field(description="parallel dimension")
    size: Degree = Field(description="its degree")


class StagePlacement(_Section):
    stage: int = Field(ge=0, description="pipeline stage index")
    layer_ranges: list[Pair] = Field(
        description="[first, last] layer of each of the stage's chunks; its k-th is model chunk stage + k*pp"
    )
    first_rank: int = Field(ge=0, description="lowest global rank of the stage (its ranks are contiguous)")
    last_rank: int = Field(ge=0, description="highest global rank of the stage")
    nodes: Pair = Field(description="[first, last] node the stage's ranks sit on")
    embedding: bool = Field(description="holds the token embedding (stage 0)")
    lm_head: bool = Field(description="holds the final norm and lm_head (last stage)")


class ExpertPlacement(_Section):
    experts_per_rank: int = Field(ge=1, description="routed experts each expert-parallel rank holds")
    expert_ranges: list[Pair] = Field(
        description="[first, last] expert of each expert-parallel rank; ep rank of global rank r = (r // etp) % ep"
    )


class PlacementSection(_Section):
    mesh_axis_order: list[str] = Field(
        description="device mesh axes outer -> inner; tp is fastest: rank = ((pp_i*dp + dp_i)*cp + cp_i)*tp + tp_i"
    )
    mesh_shape: list[MeshAxis] = Field(description="each axis of mesh_axis_order with its degree")
    gpus_per_node: int = Field(ge=1, description="node of a rank = rank // gpus_per_node")
    stages: list[StagePlacement] = Field(description="one entry per pipeline stage, in order")
    experts: ExpertPlacement | None = Field(description="routed experts per expert-parallel rank; null unless ep > 1")
    tp_splits: dict[str, SplitName] = Field(
        description="weight name -> how tensor parallelism splits it (routed experts: over etp), inventory order"
    )


class StageMemory(_Section):
    stage: int = Field(ge=0, description="pipeline stage index")
    num_ranks: int = Field(ge=1, description="GPUs that share this memory picture")
    per_gpu_bytes: dict[str, NonNegativeFloat] = Field(description="bytes per GPU by category; `total` is their sum")
    headroom_bytes: float = Field(description="capacity minus total; negative: does not fit")
    host_offload_bytes: float = Field(ge=0, description="bytes each rank keeps in CPU memory")
    nvme_offload_bytes: float = Field(ge=0, description="bytes each rank keeps on NVMe")


class MemorySection(_Section):
    per_gpu_bytes: dict[str, NonNegativeFloat] = Field(description="the binding rank's bytes by category; `total` is their sum")
    headroom_bytes: float = Field(description="capacity minus the binding rank's total")
    budget_bytes: float = Field(description="bytes a rank may use (serving: gpu_memory_utilization of capacity)")
    binding_stage: int = Field(ge=0, description="the stage that limits the plan")
    binding_component: str = Field(description="its largest category")
    stages: list[StageMemory] = Field(description="one entry per pipeline stage")


class TrainingTime(_Section):
    kind: Literal["training"] = Field(description="training figures")
    step_seconds: float = Field(gt=0, description="one optimizer step")
    tokens_per_second_per_gpu: float = Field(gt=0, description="training throughput per GPU")
    tokens_per_second: float = Field(gt=0, description="training throughput of the cluster")
    mfu: float = Field(ge=0, description="model FLOPs utilization (see assumptions)")
    hfu: float = Field(ge=0, description="hardware FLOPs utilization, recomputation included")
    num_microbatches: int = Field(ge=1, description="micro-batches per step and pipeline")
    model_flops_per_step: float = Field(gt=0, description="model FLOPs of one step")
    breakdown_seconds: dict[str, float] = Field(description="step time by part; `total` is their sum")


class ServingTime(_Section):
    kind: Literal["inference"] = Field(description="serving figures")
    batch_size: int = Field(ge=1, description="concurrent requests the figures are for")
    batch_fits_kv_cache: bool = Field(description="that batch fits the KV cache")
    ttft_seconds: float = Field(ge=0, description="time to first token")
    tpot_seconds: float = Field(ge=0, description="time per output token")
    e2e_latency_seconds: float = Field(ge=0, description="one request, end to end")
    throughput_tokens_per_second: float = Field(ge=0, description="generated tokens per second of the whole plan (all dp replicas)")
    throughput_tokens_per_second_per_gpu: float = Field(ge=0, description="the same over the plan's GPUs")
    throughput_tokens_per_second_per_replica: float | None = Field(
        default=None, ge=0, description="generated tokens per second of one replica; null in plans written before it was recorded")
    best_batch_size: int | None = Field(ge=1, description="batch with the highest throughput; null: none fits")
    prefill_breakdown_seconds: dict[str, float] = Field(description="prefill time by part; `total` is their sum")
    decode_step_breakdown_seconds: dict[str, float] = Field(description="one decode step by part")


class KvCacheSection(_Section):
    bytes_per_token: float = Field(ge=0, description="KV cache of one token, whole model")
    bytes_per_token_per_gpu: float = Field(ge=0, description="the binding rank's share of it")
    capacity_tokens: int = Field(ge=0, description="tokens the cache holds")
    num_blocks: int = Field(ge=0, description="paged blocks")
    block_size_tokens: int = Field(ge=1, description="tokens per block")
    max_model_len_tokens: int = Field(ge=1, description="tokens of one sequence")
    bytes_per_sequence: float = Field(ge=0, description="one max_model_len sequence on the binding rank")
    max_concurrent_sequences: float = Field(ge=0, description="max_model_len sequences the cache holds at once")


class BandSection(_Section):
    """The measured error band of one predicted figure (`shardplan validate`; knowledge/bands.yaml)."""

    quantity: BandQuantity = Field(description="the predicted figure")
    kind: BandKind = Field(description="the corpus whose cases set the band")
    group: str = Field(description="the engine generation (under traffic with the regime), the stack, or the stack "
                                   "and fine-tuning method")
    band_abs_error: float | None = Field(ge=0, description="the percentile of |predicted / measured - 1|, fraction; "
                                                           "null: no measured case, band unknown")
    percentile: int = Field(ge=1, le=100, description="which percentile (nearest rank)")
    mean_signed_error: float | None = Field(description="mean predicted / measured - 1, fraction; null: no case")
    num_cases: int = Field(ge=0, description="measured cases in the group")
    versions: list[str] = Field(description="the engine versions of the cases, oldest first (empty for stacks)")
    measured_on: str | None = Field(None, description="the hardware profile whose own measured cases set the band; "
                                                      "null: the shipped cases")
    note: str = Field(description="the band in words")


class FitAtBandEdgeSection(_Section):
    verdict: Literal["fits", "tight", "does not fit"] = Field(
        description="fits: at the memory band's pessimistic edge (or the band is unknown); tight: at the prediction "
                    "only; does not fit: not even at the prediction")
    band_abs_error: float | None = Field(ge=0, description="the band applied, fraction; null: unknown")
    note: str = Field(description="the verdict in words, with the band and its cases")


class PercentilesSection(_Section):
    mean: float = Field(ge=0, description="seconds")
    p50: float = Field(ge=0, description="seconds")
    p90: float = Field(ge=0, description="seconds")
    p99: float = Field(ge=0, description="seconds")


class LongRunSection(_Section):
    """The plan at its judged rate over a run of STEADY_REQUESTS_MAX requests a replica
    (traffic.over_a_long_run), and where that breaks the SLA, the highest rate a run as long
    meets it at (traffic.held_over_a_long_run): the rate to plan for."""

    request_rate_per_second: float = Field(gt=0, description="the judged rate, all replicas")
    num_requests: int = Field(ge=1, description="requests simulated, all replicas")
    sla_percentile: int = Field(ge=1, le=100, description="the percentile the SLA is at")
    ttft_seconds: PercentilesSection | None = Field(description="time to first token over the long run")
    tpot_seconds: PercentilesSection | None = Field(description="time per output token over the long run; null: no "
                                                                "request had a second token")
    within_sla: bool = Field(description="the long run meets the SLA too")
    why: str | None = Field(description="the limit it breaks; null when within")
    held_request_rate_per_second: float | None = Field(
        gt=0, description="all replicas: the highest rate whose run as long meets the SLA; null when the long run at the "
                          "judged rate meets it, or none above half of it does")
    held_ttft_seconds: PercentilesSection | None = Field(description="time to first token over the run at the held rate")
    held_tpot_seconds: PercentilesSection | None = Field(description="time per output token over the run at the held rate")


class PredictedLoadSection(_Section):
    """Serving under the traffic the plan was judged at (continuous batching by the engine's
    scheduler; `estimate --json`'s load): what a deployment of the plan should see."""

    request_rate_per_second: float | None = Field(gt=0, description="requests/s sent to the plan, all replicas; null: "
                                                                    "all at once, or a concurrency")
    max_concurrency: int | None = Field(ge=1, description="requests in flight at most; null: no cap")
    num_requests: int = Field(ge=1, description="requests simulated, all replicas")
    num_replicas: int = Field(ge=1, description="replicas the traffic is spread over (dp)")
    ttft_seconds: PercentilesSection | None = Field(description="time to first token from sending; null: no request "
                                                                "completed")
    tpot_seconds: PercentilesSection | None = Field(description="time per output token after the first, per request; "
                                                                "null: no request had a second token")
    e2e_seconds: PercentilesSection | None = Field(description="end-to-end latency from sending; null: no request "
                                                               "completed")
    request_throughput_per_second: float = Field(ge=0, description="requests completed per second, all replicas")
    output_tokens_per_second: float = Field(ge=0, description="output tokens per second, all replicas")
    total_tokens_per_second: float = Field(ge=0, description="prompt and output tokens per second, all replicas")
    saturation_request_rate_per_second: float = Field(ge=0, description="the highest rate the plan sustains with a "
                                                                        "bounded queue")
    saturated: bool = Field(description="the offered load is at or above what the plan sustains")
    long_run: LongRunSection | None = Field(default=None, description="recommend's pick at a rate: the same rate over a "
                                                                      "long run, and the rate that holds over one")

    @property
    def plan_for(self) -> tuple[float | None, PercentilesSection | None, PercentilesSection | None]:
        """(requests/s, TTFT, TPOT) a deployment should plan for: where the judged rate breaks the
        SLA over a long run, the rate a run as long holds and its figures; else the judged rate with
        the long run's figures (the steadier sample), or its own where there was no long run."""
        lr = self.long_run
        if lr is None:
            return self.request_rate_per_second, self.ttft_seconds, self.tpot_seconds
        if lr.held_request_rate_per_second is not None:
            return lr.held_request_rate_per_second, lr.held_ttft_seconds, lr.held_tpot_seconds
        return lr.request_rate_per_second, lr.ttft_seconds, lr.tpot_seconds


class SlaSection(_Section):
    """The latency limits the plan was ranked within (recommend's goodput objective): what a
    deployment of it promises, and what `watch` holds the engines' histograms against."""

    percentile: Literal[50, 90, 99] = Field(description="the limits hold at this percentile of the requests "
                                                        "(recommend's --slo-percentile)")
    max_ttft_seconds: float | None = Field(gt=0, description="time to first token at most, s; null: no limit")
    max_tpot_seconds: float | None = Field(gt=0, description="time per output token at most, s; null: no limit")
    defaulted: bool = Field(description="true: shardplan's default SLA (no --max-ttft-ms / --max-tpot-ms given)")

    @model_validator(mode="after")
    def _a_limit(self) -> "SlaSection":
        if self.max_ttft_seconds is None and self.max_tpot_seconds is None:
            raise ValueError("an SLA limits TTFT, TPOT or both: give max_ttft_seconds or max_tpot_seconds, or drop sla")
        return self


class PredictedSection(_Section):
    fits: bool = Field(description="every rank fits its memory")
    reason: str | None = Field(description="why not, when it does not fit")
    memory: MemorySection = Field(description="bytes per GPU")
    time: Annotated[Union[TrainingTime, ServingTime], Field(discriminator="kind", description="time figures")]
    kv_cache: KvCacheSection | None = Field(description="serving only")
    bands: list[BandSection] = Field(default_factory=list, description="the measured error band of each predicted "
                                     "figure; empty in plans written before bands were recorded")
    fit_at_band_edge: FitAtBandEdgeSection | None = Field(
        default=None, description="the verdict at the memory band's edge; null in plans written before it was recorded")
    load: PredictedLoadSection | None = Field(
        default=None, description="serving judged under traffic (a rate or a concurrency): its latency percentiles and "
                                  "throughput, which `time` (one static batch) is not; null otherwise, and in plans "
                                  "written before it was recorded")


class PoolSection(_Section):
    tp: int = Field(ge=1, description="tensor-parallel degree of one replica of the pool")
    replicas: int = Field(ge=1, description="replicas in the pool")


class DisaggregationSection(_Section):
    """Separate prefill and decode pools on the plan's GPUs (cost/disaggregated.py): what exporters
    launch with the engines' prefill/decode roles and a KV-transfer connector when asked."""

    prefill: PoolSection = Field(description="the replicas that compute prompts and send their KV")
    decode: PoolSection = Field(description="the replicas that receive the KV and decode")
    request_rate_per_second: float = Field(ge=0, description="the most requests/s the split carries within the SLA")
    output_tokens_per_second_per_gpu: float = Field(ge=0, description="that rate's output tokens/s per GPU")
    aggregated_output_tokens_per_second_per_gpu: float = Field(
        ge=0, description="aggregated serving's, in the same terms (the most it carries within the SLA), for comparison")
    kv_transfer_bytes_per_request: float = Field(ge=0, description="a prompt's KV cache, bytes")
    kv_transfer_seconds: float = Field(ge=0, description="its transfer between the pools, added to TTFT")
    link: str = Field(description="the link between the pools")
    winner: Literal["aggregated", "disaggregated"] = Field(description="which serving mode has more goodput per GPU")


class DeploymentManifest(_Section):
    """A plan to deploy or train one model on one cluster, with what shardplan predicts for it."""

    schema_version: int = Field(ge=1, le=SCHEMA_VERSION, description="manifest schema; newer files need a newer shardplan")
    shardplan_version: str = Field(description="the shardplan that wrote it")
    model: ModelSection = Field(description="the model and the structural facts a layout is checked against")
    hardware: HardwareSection = Field(description="the cluster")
    workload: Annotated[
        Union[InferenceWorkloadSection, TrainingWorkloadSection],
        Field(discriminator="kind", description="what the GPUs do"),
    ]
    layout: LayoutSection = Field(description="the parallel layout")
    placement: PlacementSection = Field(description="which rank holds what, and on which node")
    predicted: PredictedSection = Field(description="what shardplan's cost model predicts for this plan")
    assumptions: list[str] = Field(description="what the predictions assume, as 'key: text'")
    objective: str | None = Field(description="what the search ranked by; null: a single estimate")
    search: dict[str, int | float | str] | None = Field(description="the search's summary counts; null: no search")
    runs_on: list[str] | None = Field(None, exclude_if=lambda v: v is None, description="the targets that run this "
                                      "plan as it is (knowledge/targets.yaml); absent: not recorded (an estimate, an older plan)")
    disaggregation: DisaggregationSection | None = Field(
        None, exclude_if=lambda v: v is None, description="recommend --disaggregated: the plan's GPUs split into "
                                                          "prefill and decode pools (exports launch it with --disaggregated); absent: none")
    sla: SlaSection | None = Field(None, exclude_if=lambda v: v is None, description="the latency limits the plan was "
                                   "ranked within (serving under traffic); absent: none, or a plan written before they were recorded")

    @model_validator(mode="after")
    def _possible(self) -> "DeploymentManifest":
        _check_layout(self)
        _check_placement(self)
        return self


class Invalid(ValueError):
    """A consistency failure; `load_manifest` turns it into an InputFileError with its field and fix."""

    def __init__(self, field: str, message: str, hint: str) -> None:
        super().__init__(message)
        self.field, self.hint = field, hint


def _check_layout(m: DeploymentManifest) -> None:
    L, hw, mo = m.layout, m.hardware, m.model
    if hw.num_gpus != hw.num_nodes * hw.gpus_per_node and not (hw.num_nodes == 1 and hw.num_gpus <= hw.gpus_per_node):
        raise Invalid("hardware.num_gpus", f"{hw.num_gpus} GPUs is not {hw.num_nodes} node(s) of {hw.gpus_per_node}",
                      "make num_gpus = num_nodes x gpus_per_node")
    world = L.tp * L.pp * L.cp * L.dp
    if world != hw.num_gpus:
        raise Invalid("layout", f"tp x pp x cp x dp = {L.tp} x {L.pp} x {L.cp} x {L.dp} = {world} is not the "
                      f"{hw.num_gpus} GPUs of hardware.num_gpus", "make the degrees multiply to the GPU count")
    if mo.num_attention_heads % L.tp:
        raise Invalid("layout.tp", f"tp={L.tp} does not divide the {mo.num_attention_heads} attention heads",
                      "use a divisor of model.num_attention_heads")
    if mo.num_kv_heads % L.tp and L.tp % mo.num_kv_heads:
        raise Invalid("layout.tp", f"tp={L.tp} and the {mo.num_kv_heads} KV heads: neither divides the other",
                      "use a divisor or a multiple of model.num_kv_heads")
    if L.ep > 1 and (mo.num_experts is None or mo.num_experts % L.ep):
        what = f"does not divide the {mo.num_experts} experts" if mo.num_experts else "needs a mixture-of-experts model"
        raise Invalid("layout.ep", f"ep={L.ep} {what}", "use ep=1 or a divisor of model.num_experts")
    if L.pp * L.virtual_stages > mo.num_layers:
        raise Invalid("layout.pp", f"pp x virtual_stages = {L.pp * L.virtual_stages} exceeds the {mo.num_layers} layers",
                      "every pipeline chunk needs at least one layer")
    if m.predicted.time.kind != m.workload.kind:
        raise Invalid("predicted.time.kind", f"'{m.predicted.time.kind}' figures for a {m.workload.kind} workload",
                      "re-run shardplan recommend")
    serving = m.workload.kind == "inference"
    if (L.weight_quantization is None or L.kv_cache_dtype is None) == serving:
        raise Invalid("layout.weight_quantization", "weight_quantization and kv_cache_dtype are set for serving only",
                      "set both for inference, null both for training")
    if serving:
        _check_serving_workload(m)


def _check_serving_workload(m: DeploymentManifest) -> None:
    """The engine and its version are ones shardplan knows: their rules shaped the plan, and its
    exports launch that engine."""
    w = m.workload
    assert isinstance(w, InferenceWorkloadSection)
    try:
        engine_rules(w.engine, w.engine_version)
    except ShardplanError as e:
        raise Invalid("workload.engine_version" if e.field == "--engine-version" else "workload.engine", e.message,
                      "restore what shardplan wrote, or re-run shardplan recommend with --engine/--engine-version") from None
    # A request of the fixed lengths must fit the context (drawn lengths are clipped to it as they are drawn):
    # the engine refuses a longer one, as --input-len/--output-len are refused (cost/inputs.check_request_fits).
    drawn = w.load is not None and w.load.lengths is not None
    if w.max_model_len is not None and not drawn and w.input_len + w.output_len > w.max_model_len:
        raise Invalid("workload.input_len", f"input_len {w.input_len} + output_len {w.output_len} exceed max_model_len "
                      f"{w.max_model_len}: the engine refuses such a request",
                      "give lengths that fit, or raise workload.max_model_len (and re-run shardplan recommend)")


def _check_placement(m: DeploymentManifest) -> None:
    L, pl = m.layout, m.placement
    if pl.mesh_axis_order != list(MESH_AXIS_ORDER):
        raise Invalid("placement.mesh_axis_order", f"must be {list(MESH_AXIS_ORDER)}", "restore the order shardplan wrote")
    if [(a.axis, a.size) for a in pl.mesh_shape] != [(a, getattr(L, a)) for a in MESH_AXIS_ORDER]:
        raise Invalid("placement.mesh_shape", "does not match the layout's pp, dp, cp, tp", "copy the degrees from layout")
    if pl.gpus_per_node != m.hardware.gpus_per_node:
        raise Invalid("placement.gpus_per_node", "differs from hardware.gpus_per_node", "make them equal")
    if len(pl.stages) != L.pp:
        raise Invalid("placement.stages", f"{len(pl.stages)} stages for pp={L.pp}", "give one entry per pipeline stage")
    expected_stages = stage_placements([st.layer_ranges for st in pl.stages], L.tp * L.cp * L.dp, pl.gpus_per_node)
    for s, expected in enumerate(expected_stages):
        if pl.stages[s] != expected:
            raise Invalid(f"placement.stages.{s}", "stage index, ranks, nodes, embedding or lm_head do not follow "
                          f"from the layout (expected {expected.model_dump(exclude={'layer_ranges'})})",
                          "restore what shardplan wrote")
    for s, st in enumerate(pl.stages):
        if len(st.layer_ranges) != L.virtual_stages:
            raise Invalid(f"placement.stages.{s}.layer_ranges", f"{len(st.layer_ranges)} chunks for virtual_stages="
                          f"{L.virtual_stages}", "give one [first, last] per virtual stage")
    last_layer = m.model.num_layers - 1
    nxt = 0  # chunk c is stage c % pp's chunk c // pp; chunks hold consecutive layers in order
    for c in range(L.pp * L.virtual_stages):
        first, last = pl.stages[c % L.pp].layer_ranges[c // L.pp]
        if first != nxt or last < first:
            raise Invalid(f"placement.stages.{c % L.pp}.layer_ranges",
                          f"chunks do not cover layers 0..{last_layer} in order, {L.virtual_stages} per stage",
                          "give each chunk the layers after the previous chunk's")
        nxt = last + 1
    if nxt - 1 != last_layer:
        raise Invalid("placement.stages", f"layers end at {nxt - 1}, not {last_layer}", "cover every layer once")
    expected = expert_placement(m.model.num_experts, L.ep)
    if pl.experts != expected:
        what = "must be null unless ep > 1" if expected is None else "does not split the experts evenly over the ep ranks"
        raise Invalid("placement.experts", what, "restore what shardplan wrote")


def stage_placements(
    layer_ranges: list[list[list[int]]], ranks_per_stage: int, gpus_per_node: int
) -> list[StagePlacement]:
    """One entry per stage (`layer_ranges[s]`: its chunks). pp is the outermost axis, so the
    tp x cp x dp ranks of a stage are contiguous."""
    out = []
    for s, ranges in enumerate(layer_ranges):
        first, last = s * ranks_per_stage, (s + 1) * ranks_per_stage - 1
        out.append(StagePlacement(stage=s, layer_ranges=ranges, first_rank=first, last_rank=last,
                                  nodes=[first // gpus_per_node, last // gpus_per_node],
                                  embedding=s == 0, lm_head=s == len(layer_ranges) - 1))
    return out


def expert_placement(num_experts: int | None, ep: int) -> ExpertPlacement | None:
    """Routed experts split evenly and contiguously over the ep ranks; None unless ep > 1."""
    if num_experts is None or ep == 1:
        return None
    n = num_experts // ep
    return ExpertPlacement(experts_per_rank=n, expert_ranges=[[r * n, (r + 1) * n - 1] for r in range(ep)])


def all_field_names() -> list[str]:
    """Every key the schema knows, for 'did you mean' hints."""
    models = [DeploymentManifest, *(v for v in globals().values() if isinstance(v, type) and issubclass(v, _Section))]
    return sorted({name for model in models for name in model.model_fields})
