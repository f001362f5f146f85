"""The typed result of `estimate(...)`: what `estimate --json` prints is
`CostReport.model_dump(mode="json")`, and tables, plots and the manifest read the same model.

Pure pydantic: no yaml, rich, typer or torch (cost/ stays importable anywhere). Breakdowns stay
named mappings (`per_gpu_bytes`, `breakdown`) whose `total` is the sum of the other parts.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from shardplan.knowledge.schema import BandKind, BandQuantity

Pair = Annotated[tuple[int, int], Field(description="[first, last], both inclusive")]


class Frozen(BaseModel):
    """Strict, immutable result section."""

    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)


class OmitNone(Frozen):
    """A section some of whose keys are absent (not null) from the JSON when they do not apply:
    the fields named in `OMIT_IF_NONE` are dropped from the dump when None."""

    OMIT_IF_NONE: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _omit(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        for name in self.OMIT_IF_NONE:
            if getattr(self, name) is None:
                data.pop(name, None)
        return data


class ModelReport(Frozen):
    name: str = Field(description="the model spec's name")
    num_params: int = Field(description="stored parameters (count)")
    num_active_params: int = Field(description="parameters one token uses (count; MoE: routed top-k only)")


class HardwareReport(Frozen):
    name: str = Field(description="hardware profile name")
    num_gpus: int = Field(description="GPUs in the cluster (count)")
    gpus_per_node: int = Field(description="GPUs per node (count)")
    num_nodes: int = Field(description="nodes (count)")
    memory_capacity_bytes: int = Field(description="memory of one GPU, bytes")


class SpeculativeReport(Frozen):
    method: Literal["draft_model", "mtp", "ngram"] = Field(description="vLLM's speculative method name")
    num_speculative_tokens: int = Field(description="tokens proposed per step (K); also lookahead slots per sequence")
    draft_model: str | None = Field(description="the draft model's spec name (draft_model); null otherwise")
    draft_source: str | None = Field(description="where the draft spec was loaded from, as given; null: none")
    draft_hf_id: str | None = Field(description="the draft's Hugging Face id; null: unknown or none")


class InferenceWorkloadReport(Frozen):
    kind: Literal["inference"] = Field(description="serving")
    max_model_len: int | None = Field(description="tokens per sequence the engine admits; null: the model's maximum")
    max_num_seqs: int = Field(description="sequences the engine schedules at once (count)")
    max_num_batched_tokens: int = Field(description="tokens in one forward, tokens")
    gpu_memory_utilization: float = Field(description="fraction of device memory the engine may use")
    block_size: int = Field(description="tokens per paged KV block")
    kv_cache_dtype: str | None = Field(description="KV-cache format; null: the activation dtype")
    activation_dtype: str = Field(description="activation format")
    quantization: str = Field(description="weight format")
    enforce_eager: bool = Field(description="no CUDA graphs")
    input_len: int = Field(description="prompt length, tokens")
    output_len: int = Field(description="generated length, tokens")
    batch_size: int | None = Field(description="concurrent sequences per replica; null: the most that fit")
    kv_read_per_query_head: bool = Field(description="attention reads K/V once per query head")
    engine: str = Field(description="the serving engine whose rules shaped the figures")
    engine_version: str | None = Field(description="its version; null: the fields as given, no version rules")
    cuda_context_in_budget: bool = Field(description="the engine's budget counts the CUDA context")
    cuda_graphs_in_budget: bool = Field(description="the engine's budget counts CUDA graphs")
    refusal: str = Field(description="how the engine refuses a max_model_len that does not fit: tokens (vLLM V0), bytes "
                                     "(V1) or no_room (SGLang: only an empty pool)")
    accounting: str = Field(description="profiled (vLLM: the profiling pass's peak is subtracted), warmup (TGI), "
                                        "free_fraction (TensorRT-LLM) or static_fraction "
                                        "(SGLang: a pool of free memory x fraction holds weights and KV)")
    static_fraction_by_tp: list[tuple[int, float]] = Field(description="SGLang's default pool fraction by "
                                                           "tensor-parallel size, (min_tp, fraction); empty: as given")
    static_fraction_by_tp_pipelined: list[tuple[int, float]] = Field(
        default_factory=list, description="the same with pipeline stages (pp > 1) where that differs; empty: the same")
    python_ops_per_layer: float = Field(description="framework ops per decoder layer the engine issues from Python "
                                                    "in eager mode (host time)")
    python_ops_per_layer_parts: dict[str, float] = Field(
        default_factory=dict, description="eager framework ops of a decoder layer by part; empty: python_ops_per_layer "
                                          "for every layer")
    python_ops_per_step: float = Field(description="eager framework ops per step for the logits and the sampler")
    cuda_graph_max_batch: int = Field(description="decode batches up to this size replay CUDA graphs; 0: none")
    step_overhead_seconds: float = Field(description="host work per step the GPU waits for (scheduler, outputs), s")
    sampler_bytes_per_logit: float = Field(description="bytes per logit the profiling pass's dummy sampler holds")
    non_torch_bytes: float | None = Field(description="non-torch memory beyond the CUDA context and NCCL, bytes; "
                                                      "null: the hardware profile's")
    warmup_free_share: float = Field(description="TGI: the share of the free memory sized as KV")
    warmup_total_factor: float = Field(description="TGI >= 3: the device share held back is 1 - fraction x this")
    warmup_kv_tokens: int = Field(description="TGI: the warm-up batch's KV tokens, counted back into the cache")
    prefill_logit_bytes: float = Field(description="bytes per logit the profiling prefill holds for every token")
    prefill_logit_bytes_gathered: float = Field(
        0.0, description="the same with the lm_head split over tensor-parallel ranks and gathered; 0: as above")
    attention_workspace_bytes: float = Field(
        0.0, description="TGI: a buffer the attention backend allocates in the warm-up and keeps, bytes")
    speculative: SpeculativeReport | None = Field(None, description="speculative decoding; null: off")
    vision_encoder_tokens: int = Field(0, description="tokens the vision tower runs over in the profiling pass")
    vision_kept_tokens: int = Field(0, description="encoder output rows alive during the text profiling pass")
    offload_mode: str = Field("stream", description="how offloaded layers run: stream (copied to the GPU every "
                                                     "forward) or host_compute (run on the CPU)")
    offload_gpu_layers: str = Field("last", description="which decoder layers stay on the GPU when offloading")
    offload_overlap: bool = Field(False, description="offloaded weights' copies overlap compute")
    offload_embedding_on_host: bool = Field(False, description="the token embedding stays in host memory")
    offload_kv_with_layer: bool = Field(False, description="an offloaded layer's KV cache lives in host memory")
    offload_batch_on_gpu_min_tokens: int = Field(0, description="prompt batches of at least this many tokens multiply "
                                                                "host-resident weights on the GPU")
    offload_targets: list[str] = Field(default_factory=list, description="where the engine can offload weights")
    offload_keeps_quantization: bool = Field(True, description="offloaded layers keep the plan's weight format")
    offload_stream_unit: str = Field("layer", description="what one streamed copy holds on the GPU: layer or tensor")
    offload_pinned: bool = Field(True, description="streamed copies come from pinned host memory (false: pageable)")
    weight_formats: list[str] = Field(default_factory=list, description="quantized weight formats the engine loads")
    chunked_prefill: bool = Field(True, description="prompts are computed in chunks of the token budget")
    schedule: str = Field("mixed", description="how the engine composes a step under continuous batching: mixed, "
                                               "prefill_first or static (knowledge/engines/*.yaml)")
    graphs_for_prompt_steps: bool = Field(False, description="steps with prompt tokens replay CUDA graphs")
    admission: list[float] | None = Field(None, description="admission reserve: initial ratio, floor factor, decay "
                                                            "steps, output clip in tokens (SGLang new_token_ratio)")
    admit_after_preemption: bool = Field(True, description="a step that preempted still admits waiting requests (false: vLLM V1)")
    batches_in_flight: int = Field(1, ge=1, le=2, description="2: the next step's batch is formed while a step runs "
                                                              "(overlap or async scheduling)")
    batches_in_flight_pp1_only: bool = Field(False, description="pipeline parallelism turns that off (vLLM)")
    hybrid_kv_cache: bool = Field(False, description="sliding-window layers hold only their window's KV blocks per request "
                                                     "(vLLM V1's hybrid KV cache manager)")
    kv_tokens_reported: str = Field("blocks", description="what the logged KV cache size counts: blocks (blocks per KV "
                                                          "cache group x block size) or concurrency (max concurrency x "
                                                          "max_model_len)")
    kv_heads_copied: bool = Field(True, description="the engine copies KV heads where tp exceeds them (false: tp must "
                                                    "divide them, TGI)")
    speculative_with_pp: bool = Field(True, description="speculative decoding runs with pipeline parallelism (false: the "
                                                        "engine refuses the two together, SGLang)")
    fp8_marlin_architectures: list[str] = Field(default_factory=list, description="GPU architectures with FP8 tensor cores "
                                                "on which the engine still runs FP8 weights through Marlin (TGI on Ada)")
    sliding_window_in_flight_batches: int = Field(1, description="batches of the token budget a sliding-window KV "
                                                                 "group holds per request beyond its window (2: "
                                                                 "vLLM >= 0.26 with async scheduling)")


class TrainingWorkloadReport(Frozen):
    kind: Literal["training"] = Field(description="training")
    seq_len: int = Field(description="tokens per sequence")
    global_batch_size: int = Field(description="sequences per optimizer step")
    optimizer: str = Field(description="optimizer whose states are kept")
    framework: str = Field(description="whose bookkeeping of model states is followed")
    param_dtype: str = Field(description="weight and gradient format")
    activation_dtype: str = Field(description="activation format")
    flash_attention: bool = Field(description="no seq_len^2 score tensor is stored")
    dropout: bool = Field(description="dropout masks are stored")
    loss_fp32_logits: bool = Field(description="the loss works on fp32 logits")
    overlap_grad_reduce: bool = Field(description="the gradient reduction overlaps the backward")
    stack: str | None = Field(description="the training stack whose rules these follow; null: as given")
    loss_bytes_per_logit: float | None = Field(description="bytes per logit the loss head holds at its peak; null: "
                                                           "the fp32 logits once")
    loss_vocab_parallel: bool = Field(description="the logits stay split over tensor-parallel ranks")
    loss_parallel_bytes_per_logit: float | None = Field(
        description="with tensor parallelism, bytes per local logit of the stack's loss-parallel cross-entropy; "
                    "null: loss_bytes_per_logit")
    largest_allocation_bytes_per_logit: float = Field(description="the loss head's largest tensor, bytes per logit "
                                                                  "(headroom the caching allocator needs); 0: not checked")
    selective_policy: str = Field(description="what --recompute selective keeps: attention_core or op_level")
    recompute_offered: list[str] = Field(description="the checkpointing the stack offers")
    amp_fp32_master: bool = Field(description="fp32 weights under bf16 autocast, with cached bf16 copies")
    norms_fp32: bool = Field(description="norms save an fp32 copy of their input")
    zero_reduce_bucket_elements: int = Field(description="ZeRO's contiguous gradient bucket, elements (DeepSpeed "
                                                         "reduce_bucket_size); 0: none")
    eager_softmax_fp32: bool = Field(description="unfused attention keeps its softmax output in fp32 (transformers' "
                                                 "eager attention by family, or under autocast)")
    grads_allocated_in_backward: bool = Field(description="the gradients are allocated in backward as the activations "
                                                          "are freed (set to None after each step)")
    ddp_gradient_buckets: bool = Field(description="DDP's reducer keeps a bucket copy of every gradient (ZeRO 0 over "
                                                   "data-parallel ranks)")
    elementwise_fused: bool = Field(description="norms, RoPE and SwiGLU run as fused kernels")
    attention_kernels: list[str] = Field(description="the stack's attention kernels in order of preference; "
                                                     "empty: the profile's attention efficiency")
    norm_bytes_per_element: float = Field(description="eager norm traffic, bytes per element (16-bit)")
    norm_kernels: int = Field(description="kernels of one eager norm")
    rope_bytes_per_element: float = Field(description="eager RoPE traffic, bytes per element (16-bit)")
    rope_kernels: int = Field(description="kernels of the eager RoPE")
    act_bytes_per_element: float = Field(description="eager MLP activation traffic, bytes per element (16-bit)")
    act_kernels: int = Field(description="kernels of the eager MLP activation")
    eager_attention_bytes_per_score: float = Field(description="unfused attention's forward traffic per score element "
                                                               "(16-bit, dropout included)")
    loss_forward_bytes_per_logit: float = Field(description="the loss head's forward memory traffic, bytes per logit")
    loss_backward_bytes_per_logit: float = Field(description="the loss head's backward memory traffic, bytes per logit")
    matmul_dtype: str = Field(description="the linear layers' GEMM format (fp8: dynamic scaling)")
    pp_holds_stage_outputs: bool = Field(description="the pipeline runtime keeps each in-flight micro-batch's stage "
                                                     "output until its backward (torch.distributed.pipelining)")
    fsdp_unsharded_under_pp: bool = Field(description="FSDP keeps stage parameters and fp32 gradients unsharded "
                                                      "under pipeline parallelism")
    tp_comm_overlap: bool = Field(description="tensor-parallel collectives overlap the GEMMs they feed")
    pp_p2p_overlap: bool = Field(description="pipeline sends overlap compute under the interleaved schedule")
    collectives_multirail: bool = Field(description="cross-node collectives reach the NICs of all the group's ranks "
                                                    "in a node")
    finetune: str = Field(description="full: every weight trains; lora / qlora: adapters on a frozen base")
    lora_rank: int = Field(description="LoRA rank r")
    lora_alpha: float = Field(description="LoRA alpha (adapter scaling alpha / r)")
    lora_targets: list[str] = Field(description="the linear modules the adapters sit on (all-linear: every decoder linear)")
    lora_dropout: float = Field(description="dropout on the adapters' input (PEFT lora_dropout)")
    base_format: str = Field(description="storage of the frozen base's decoder linears: none (the dtype), nf4, nf4-dq")
    base_fp32_non_quantized: bool = Field(description="the base's non-quantized parameters are upcast to fp32 (PEFT)")
    paged_optimizer: bool = Field(description="optimizer states in CUDA unified memory, paged out to the host")
    master_dtype: str = Field(description="the optimizer's master weights (and DeepSpeed's gradient partition)")
    moment_dtype: str = Field(description="the optimizer's moments (Adam's m and v)")
    grad_reduce_dtype: str = Field(description="Megatron-Core's main gradients, which data parallelism reduces (fp32: "
                                               "grad_reduce_in_fp32)")
    optimizer_foreach: bool = Field(description="torch's foreach AdamW: the step allocates a parameter-sized list")
    moe_expert_outputs_saved: bool = Field(description="MoE layers keep their routed experts' outputs for the router "
                                                       "probabilities' gradient")
    fp8_saves_quantized_inputs: bool = Field(description="under fp8 GEMMs the linears save their inputs' fp8 copies")
    recompute_modules: list[str] = Field(description="what selective recomputation recomputes (Megatron-Core "
                                                     "--recompute-modules); empty: the stack's selective policy")


WorkloadReport = Annotated[Union[InferenceWorkloadReport, TrainingWorkloadReport], Field(discriminator="kind")]


class OffloadReport(Frozen):
    optimizer: str = Field(description="where optimizer states live off the GPU (none, cpu, nvme)")
    params: str = Field(description="where parameters live off the GPU (none, cpu, nvme)")
    layers: int = Field(0, description="serving: decoder layers whose weights are held there instead of the GPU")


class PlanReport(Frozen):
    tp: int = Field(description="tensor-parallel degree (1: off)")
    pp: int = Field(description="pipeline stages")
    dp: int = Field(description="data-parallel degree; serving: replicas")
    ep: int = Field(description="expert-parallel degree")
    etp: int = Field(description="tensor-parallel degree inside each expert")
    cp: int = Field(description="context-parallel degree")
    zero_stage: int = Field(description="ZeRO stage, 0 none to 3 parameters")
    hybrid_shard: bool = Field(description="ZeRO/FSDP shards within a node only")
    sequence_parallel: bool = Field(description="Megatron sequence parallelism")
    recompute: str = Field(description="activation recomputation")
    pp_schedule: str = Field(description="pipeline schedule")
    virtual_stages: int = Field(description="model chunks per pipeline stage")
    micro_batch_size: int = Field(description="sequences per micro-batch")
    offload: OffloadReport = Field(description="offload targets")
    stage_layers: list[int] = Field(default_factory=list, description="decoder layers on each pipeline stage")


class ServingPlanReport(PlanReport):
    """A searched serving plan: the layout plus the formats and batch the search chose."""

    replicas: int = Field(description="model replicas (= dp)")
    quantization: str = Field(description="weight format")
    kv_cache_dtype: str = Field(description="KV-cache format; auto: the activation dtype")
    batch_size: int | None = Field(description="concurrent sequences per replica")


class RankMemoryReport(Frozen):
    stage: int = Field(description="pipeline stage index")
    layers: Pair = Field(description="first and last layer the stage holds (interleaved: see layer_chunks)")
    layer_chunks: list[Pair] = Field(description="[first, last] layer of each model chunk the stage holds")
    num_ranks: int = Field(description="GPUs sharing this memory picture (count)")
    per_gpu_bytes: dict[str, float] = Field(description="bytes per GPU by component; `total` is their sum")
    headroom_bytes: float = Field(description="capacity minus total, bytes; negative: does not fit")
    reserved_bytes: float = Field(description="what the caching allocator reserves at the peak: the total plus a "
                                              "fresh block for the largest single tensor, bytes (>= total)")
    largest_allocation_bytes: float = Field(description="the largest single tensor at the peak, bytes")
    largest_allocation: str = Field(description="what it is (training: the fp32 logits of the loss); empty: none")
    detail_bytes: dict[str, float] = Field(description="named sub-items, bytes")
    host_offload_bytes: float = Field(description="bytes this rank keeps in CPU memory")
    nvme_offload_bytes: float = Field(description="bytes this rank keeps on NVMe")


class MemoryReport(Frozen):
    per_gpu_bytes: dict[str, float] = Field(description="the binding rank's bytes by component; `total` is their sum")
    binding_stage: int = Field(description="the stage that limits the plan")
    binding_component: str = Field(description="its largest component")
    budget_bytes: float = Field(description="bytes a rank may use (serving: gpu_memory_utilization x capacity)")
    headroom_bytes: float = Field(description="capacity minus the binding rank's total, bytes")
    per_rank: list[RankMemoryReport] = Field(description="one entry per pipeline stage")


class TrainingMemoryReport(MemoryReport):
    host_offload_bytes_per_node: float = Field(description="CPU memory for offloaded states, bytes per node")
    nvme_offload_bytes_per_node: float = Field(description="NVMe for offloaded states, bytes per node")
    num_microbatches: int = Field(description="micro-batches per step and pipeline (count)")


class KvCacheReport(Frozen):
    bytes_per_token: float = Field(description="KV cache of one token, whole model, bytes")
    bytes_per_token_per_gpu: float = Field(description="the binding rank's share, bytes per token")
    capacity_tokens: int = Field(description="tokens the cache holds")
    num_blocks: int = Field(description="paged blocks (count)")
    block_size: int = Field(description="tokens per block")
    max_model_len: int = Field(description="tokens of one sequence")
    bytes_per_sequence: float = Field(description="one max_model_len sequence on the binding rank, bytes")
    max_concurrency: float = Field(description="max_model_len sequences the cache holds at once (count)")


class ServingBreakdown(Frozen):
    prefill: dict[str, float] = Field(description="prefill time by part, seconds; `total` is their sum")
    decode_step: dict[str, float] = Field(description="one decode step by part, seconds; `total` is their sum")


class ServingTimeReport(Frozen):
    batch_size: int = Field(description="concurrent sequences per replica the figures are for")
    input_len: int = Field(description="prompt length, tokens")
    output_len: int = Field(description="generated length, tokens")
    plan_fits: bool = Field(True, description="false: the plan does not fit, and these are the times it would have")
    batch_fits_kv_cache: bool = Field(description="that batch fits the KV cache")
    max_batch_in_kv_cache: int = Field(description="sequences of input_len + output_len the cache holds (count)")
    ttft_seconds: float = Field(description="time to first token, seconds")
    tpot_seconds: float = Field(description="time per output token, seconds")
    e2e_latency_seconds: float = Field(description="one request end to end, seconds")
    throughput_tokens_per_second: float = Field(description="output tokens per second of the whole plan (all dp replicas)")
    throughput_tokens_per_second_per_gpu: float = Field(description="the plan's output tokens per second / its GPUs")
    throughput_tokens_per_second_per_replica: float = Field(description="output tokens per second of one replica")
    best_batch_size: int | None = Field(description="batch per replica with the highest throughput; null: none fits")
    best_throughput_tokens_per_second: float | None = Field(
        description="output tokens per second of the whole plan at best_batch_size; null: none fits")
    breakdown: ServingBreakdown = Field(description="where prefill and decode time go")
    overlap_assumptions: dict[str, str] = Field(description="what overlaps with compute, per collective")


class TrainingTimeReport(Frozen):
    plan_fits: bool = Field(True, description="false: the plan does not fit, and this is the time it would take if it did")
    step_seconds: float = Field(description="one optimizer step, seconds")
    tokens_per_second_per_gpu: float = Field(description="trained tokens per second per GPU")
    tokens_per_second: float = Field(description="trained tokens per second of the whole plan")
    mfu: float = Field(description="model FLOPs utilization, fraction")
    hfu: float = Field(description="hardware FLOPs utilization (recomputation included), fraction")
    flop_convention: str = Field(description="how model FLOPs are counted")
    model_flops_per_step: float = Field(description="model FLOPs of one step")
    hardware_flops_per_step: float = Field(description="FLOPs executed in one step, recomputation included")
    breakdown: dict[str, float] = Field(description="step time by part, seconds; `total` is their sum")
    overlap_assumptions: dict[str, str] = Field(description="what overlaps with compute, per collective")


TimeReport = Union[ServingTimeReport, TrainingTimeReport]


class PredictionBand(Frozen):
    """How far the model's prediction of one quantity fell from measurements of the same engine
    generation or stack (`shardplan validate`; `knowledge/bands.yaml`)."""

    quantity: BandQuantity = Field(
        description="the predicted quantity: KV capacity (tokens), peak memory (bytes), tokens/s per GPU; under "
                    "traffic (`load`) the median TTFT and TPOT and the output tokens/s")
    kind: BandKind = Field(description="the corpus whose cases set the band")
    group: str = Field(description="the engine generation (under traffic with the regime: 'vLLM V1, saturated'), "
                                   "the stack, or the stack and fine-tuning method")
    band_abs_error: float | None = Field(description="the percentile of |predicted / measured - 1| over the group's "
                                                     "cases, fraction; null: no measured case, band unknown")
    percentile: int = Field(description="which percentile band_abs_error is (nearest rank)")
    mean_signed_error: float | None = Field(description="mean predicted / measured - 1 of the cases, fraction (above "
                                                        "0: the model predicts more); null: no case")
    num_cases: int = Field(description="measured cases in the group (count; 0: band unknown)")
    versions: list[str] = Field(description="the engine versions of the cases, oldest first (empty for stacks)")
    measured_on: str | None = Field(None, description="the hardware profile whose own measured cases (its "
                                                      "`measured_cases:`) set the band; null: the shipped cases")
    note: str = Field(description="the band in words, e.g. '±3.4% (p90 of 11 vLLM V1 0.8.5-0.10.2 start-up logs)'")


class FitAtBandEdge(Frozen):
    """Whether the plan fits at the pessimistic edge of its band: training, the largest reserved
    peak x (1 + the peak-memory band) within the device; serving, the KV capacity x (1 - the KV
    band) holding one max_model_len sequence."""

    verdict: Literal["fits", "tight", "does not fit"] = Field(
        description="fits: at the band's edge (or the band is unknown and it fits at the prediction); tight: fits "
                    "at the prediction only; does not fit: not even at the prediction")
    quantity: Literal["kv_capacity", "peak_memory"] = Field(description="the figure the edge is taken on")
    unit: Literal["bytes", "tokens"] = Field(description="the unit of predicted, at_band_edge and limit")
    predicted: float = Field(description="the prediction (reserved peak bytes of the largest rank, or KV tokens)")
    at_band_edge: float | None = Field(description="the prediction at the band's pessimistic edge; null: band unknown")
    limit: float = Field(description="what it must stay within (device bytes) or reach (max_model_len tokens)")
    band_abs_error: float | None = Field(description="the band applied, fraction; null: unknown")
    note: str = Field(description="the verdict in words, with the band and its cases")


class LatencyPercentiles(Frozen):
    mean: float = Field(description="seconds")
    p50: float = Field(description="seconds")
    p90: float = Field(description="seconds")
    p99: float = Field(description="seconds")


class LoadReport(Frozen):
    """The plan under traffic: continuous batching by the engine's scheduler (cost/serving_load.py)."""

    request_rate: float | None = Field(description="requests per second sent to the plan; null: all at once (inf)")
    max_concurrency: int | None = Field(description="requests in flight at most; null: no cap")
    num_requests: int = Field(description="requests simulated")
    lengths: str = Field(description="where the request lengths come from: fixed, sharegpt or a file")
    mean_input_tokens: float = Field(description="mean prompt tokens of the requests simulated")
    mean_output_tokens: float = Field(description="mean output tokens of the requests simulated")
    prefix_cache_hit: float = Field(description="share of each prompt found in the prefix cache")
    num_replicas: int = Field(description="replicas the traffic is spread over (dp)")
    ttft_seconds: LatencyPercentiles = Field(description="time to first token from sending")
    tpot_seconds: LatencyPercentiles = Field(description="time per output token after the first, per request")
    e2e_seconds: LatencyPercentiles = Field(description="end-to-end latency from sending")
    itl_seconds: LatencyPercentiles | None = Field(
        None, description="inter-token latency: the gaps between a request's successive tokens over all requests, "
                          "as the benchmark clients' ITL figures")
    request_throughput_per_second: float = Field(description="requests completed per second, all replicas")
    output_tokens_per_second: float = Field(description="output tokens per second, all replicas")
    output_tokens_per_second_per_gpu: float = Field(description="output tokens per second over all the plan's GPUs")
    total_tokens_per_second: float = Field(description="prompt and output tokens per second, all replicas")
    saturation_request_rate: float = Field(description="the highest request rate the plan sustains with a bounded "
                                                       "queue (its throughput with every request ready at once)")
    saturated: bool = Field(description="the offered load is at or above what the plan sustains (a rate at or above "
                                        "the saturation rate; with a concurrency cap: not all requests can run at once)")
    num_steps: int = Field(description="engine steps one replica ran")
    num_preemptions: int = Field(description="requests preempted (KV cache full) and recomputed, one replica")
    num_refused: int = Field(description="requests the engine could never hold, one replica")
    peak_running: int = Field(description="requests running at once at most, one replica")
    mean_decode_batch: float = Field(description="decoding requests per step that had any, one replica")
    schedule: str = Field(description="the engine's scheduling rule the simulation followed")
    tokens_per_decode_step: float = Field(1.0, description="tokens a decode step yields per request (speculative "
                                                           "decoding with --spec-acceptance-rate: above 1)")


class CostReport(OmitNone):
    """What `estimate --json` prints. `kv_cache` is serving only and absent from training's JSON."""

    OMIT_IF_NONE: ClassVar[frozenset[str]] = frozenset({"kv_cache", "assumptions", "bands", "fit_at_band_edge", "load"})

    model: ModelReport = Field(description="the model")
    hardware: HardwareReport = Field(description="the cluster")
    workload: WorkloadReport = Field(description="what the GPUs do")
    plan: PlanReport = Field(description="the parallel layout")
    fits: bool = Field(description="every rank fits its memory")
    reason: str | None = Field(description="why not, when it does not fit")
    memory: Union[TrainingMemoryReport, MemoryReport] = Field(description="bytes per GPU")
    kv_cache: KvCacheReport | None = Field(default=None, description="serving only")
    time: TimeReport = Field(description="serving or training time figures")
    load: LoadReport | None = Field(default=None, description="serving under traffic (--request-rate / --concurrency); "
                                                              "absent without")
    assumptions: list[str] | None = Field(default=None, description="serving: each engine rule that shaped the "
                                          "figures, with its source (absent in training)")
    bands: list[PredictionBand] | None = Field(default=None, description="the measured error band of each predicted "
                                               "quantity (serving: KV capacity; training: peak memory, tokens/s); "
                                               "absent where none was attached (cost/accuracy.py attaches them)")
    fit_at_band_edge: FitAtBandEdge | None = Field(default=None, description="fits / tight / does not fit at the "
                                                   "memory band's pessimistic edge; absent with bands")

    @property
    def training(self) -> bool:
        return isinstance(self.time, TrainingTimeReport)
