"""Measured cases: a real run's inputs and what it measured, typed, so that the cost model can
predict the same run and be judged against it.

Four kinds, each the shape of one published corpus shardplan ships (and the schema of a user's
`--cases` file):

- `engine_log`: a serving engine's start-up (vLLM, SGLang, TGI, TensorRT-LLM) and the KV-cache
  capacity it printed, or its refusal to start;
- `training`: a training step of a stack (torchtitan, Megatron, DeepSpeed, Hugging Face) with its
  peak memory and/or tokens per second per GPU;
- `finetune`: a LoRA / QLoRA run's peak memory;
- `serving_load`: a serving benchmark's run (vLLM's `bench serve` / `benchmark_serving`, SGLang's
  `bench_serving`) on vLLM or SGLang: the traffic the clients sent and the median TTFT, median
  TPOT and output throughput they reported.

Units are in the field names (`_gib`, `_bytes`, `_per_second`); a flag left out takes the
engine's or the stack's default, as `estimate` does.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, Tag, model_validator

from shardplan.specs._base import StrictModel

# Megatron-Core's --recompute-modules (megatron/core/transformer/transformer_config.py recompute_modules);
# the training stacks' knowledge (knowledge/stacks/*.yaml) names its modules from this list.
RecomputeModule = Literal["core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts"]

Positive = Annotated[int, Field(gt=0, le=1_000_000)]


class _Case(StrictModel):
    id: str = Field(..., min_length=1, max_length=200, pattern=r"^[A-Za-z0-9_.:+-]+$",
                    description="a short name for the case (letters, digits, _ . : + -)")
    source: str = Field(..., min_length=1, max_length=2000, description="where the measurement comes from (URL, log, job)")
    model: str | None = Field(..., max_length=500, description="a bundled model name, a config.json or a spec YAML")
    hardware: str = Field(..., min_length=1, max_length=500, description="a bundled GPU profile name or a profile YAML")
    gpus: Positive


class EngineFlags(StrictModel):
    """The command-line settings a start-up used, in each engine's own words; absent: the default."""

    max_model_len: Positive | None = None
    max_num_seqs: Positive | None = None
    max_num_batched_tokens: Positive | None = None
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    enable_chunked_prefill: bool | None = None
    enforce_eager: bool | None = None
    limit_mm_per_prompt: Positive | None = Field(None, description="images per prompt the profiling pass assumes")
    quantization: str | None = Field(None, max_length=40, description="vLLM --quantization (fp8, awq, gptq, ...)")
    kv_cache_dtype: str | None = Field(None, max_length=40)
    async_scheduling: bool | None = Field(None, description="vLLM --async-scheduling")
    # SGLang
    disable_overlap_schedule: bool | None = None
    mem_fraction_static: float | None = Field(None, gt=0, le=1)
    context_length: Positive | None = None
    chunked_prefill_size: Positive | None = None
    max_running_requests: Positive | None = None
    disable_cuda_graph: bool | None = None
    # TGI
    cuda_memory_fraction: float | None = Field(None, gt=0, le=1)
    max_batch_prefill_tokens: Positive | None = None
    max_total_tokens: Positive | None = None
    max_input_tokens: Positive | None = None
    max_batch_total_tokens: Positive | None = None
    num_shard: Positive | None = None
    quantize: str | None = Field(None, max_length=40, description="TGI --quantize")


class EngineLogCase(_Case):
    kind: Literal["engine_log"] = "engine_log"
    model: str = Field(..., min_length=1, max_length=500)
    engine: Literal["vllm", "sglang", "tgi", "trtllm"]
    engine_version: str = Field(..., min_length=1, max_length=40)
    tp: Positive = 1
    pp: Positive = 1
    device_total_gib: float | None = Field(
        None, gt=0, le=4096, description="the device memory the log prints (vLLM total_gpu_memory); absent: the profile's")
    device_free_gib: float | None = Field(
        None, gt=0, le=4096, description="SGLang: the free memory it prints before loading")
    flags: EngineFlags = EngineFlags()
    kv_cache_tokens: int | None = Field(None, ge=0, le=10**12, description="the KV capacity the engine printed (tokens)")
    started: bool = Field(..., description="whether the engine started (false: it refused)")


class TrainingMeasured(StrictModel):
    peak_memory_gib: float | None = Field(None, gt=0, le=4096, description="peak memory per GPU (GiB)")
    memory_counter: Literal["allocated", "reserved"] = Field(
        "reserved", description="allocated: torch.cuda.max_memory_allocated; reserved: the caching allocator's "
                                "reserved peak or nvidia-smi")
    tokens_per_second_per_gpu: float | None = Field(None, gt=0, le=1e9)

    @model_validator(mode="after")
    def _something(self) -> "TrainingMeasured":
        if self.peak_memory_gib is None and self.tokens_per_second_per_gpu is None:
            raise ValueError("give peak_memory_gib, tokens_per_second_per_gpu or both")
        return self


class TrainingCase(_Case):
    kind: Literal["training"] = "training"
    stack: Literal["megatron", "torchtitan", "deepspeed", "hf"]
    shape: dict | None = Field(None, description="shipped rows: the model's shape where no config is bundled")
    tp: Positive = 1
    pp: Positive = 1
    dp: Positive | None = None
    cp: Positive = 1
    ep: Positive = 1
    vp: Positive = 1
    sequence_parallel: bool | None = None
    zero_stage: int = Field(0, ge=0, le=3)
    micro_batch: Positive
    seq_len: Positive
    global_batch: Positive | None = None
    recompute: Literal["none", "selective", "full"] = "none"
    recompute_modules: list[RecomputeModule] | None = Field(
        None, max_length=16, description="Megatron-Core --recompute-modules under selective; null: the stack's default")
    flash_attention: bool | None = None
    dropout: bool = False
    fp8: bool = Field(False, description="fp8 linear GEMMs")
    compile: bool = False
    compile_loss: bool | None = None
    tp_comm_overlap: bool = False
    pp_embedding_as_layer: bool = False
    pp_loss_as_layer: bool = False
    master_dtype: Literal["fp32", "bf16"] = "fp32"
    moment_dtype: Literal["fp32", "bf16"] = "fp32"
    reduce_bucket_size: Annotated[int, Field(ge=1, le=10**11)] | Literal["auto"] | None = Field(
        None, description="DeepSpeed's zero_optimization.reduce_bucket_size (elements, or auto); null: the stack's")
    overlap_comm: bool = Field(True, description="data-parallel reductions overlap the backward (DeepSpeed overlap_comm)")
    measured: TrainingMeasured

    @model_validator(mode="after")
    def _model_or_shape(self) -> "TrainingCase":
        if self.model is None and self.shape is None:
            raise ValueError("give model (a bundled name or a config.json)")
        return self


class FineTuneCase(_Case):
    kind: Literal["finetune"] = "finetune"
    model: str = Field(..., min_length=1, max_length=500)
    stack: Literal["megatron", "torchtitan", "deepspeed", "hf"]
    finetune: Literal["lora", "qlora"]
    zero_stage: int = Field(0, ge=0, le=3)
    micro_batch: Positive
    global_batch: Positive
    seq_len: Positive
    recompute: Literal["none", "selective", "full"] = "none"
    lora_rank: Positive = 16
    lora_targets: list[str] = Field(default_factory=lambda: ["all-linear"], min_length=1, max_length=64)
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    double_quant: bool = True
    optimizer: Literal["adamw", "adam", "sgd", "adamw8bit"] = "adamw"
    counter: Literal["allocated", "reserved", "capacity"] = Field(
        ..., description="allocated: torch.cuda.max_memory_allocated; reserved: nvidia-smi; capacity: the run filled "
                         "the device (the longest sequence that fit)")
    measured_bytes: float | None = Field(None, gt=0, le=2**42, description="the peak memory printed (bytes)")

    @model_validator(mode="after")
    def _measured(self) -> "FineTuneCase":
        if self.counter != "capacity" and self.measured_bytes is None:
            raise ValueError(f"counter {self.counter} needs measured_bytes")
        return self


class ServingLoadMeasured(StrictModel):
    """What a serving benchmark's result block reports."""

    median_ttft_ms: float = Field(..., gt=0, le=1e9, description="Median TTFT (ms)")
    median_tpot_ms: float | None = Field(None, gt=0, le=1e8, description="Median TPOT (ms); absent: one-token outputs")
    median_itl_ms: float | None = Field(None, gt=0, le=1e8, description="Median ITL (ms); absent: not reported")
    output_tokens_per_second: float = Field(..., gt=0, le=1e9, description="Output token throughput (tok/s)")


class ServingLoadCase(_Case):
    """One benchmark run against one engine deployment: the deployment as `estimate` takes it
    (model, GPU, engine and version, its flags, tp/pp/ep, the checkpoint's weight format) and the
    traffic as the client sent it. `dataset` random: vLLM's client sends every prompt at
    `input_len` (outputs end at EOS unless ignore_eos: their mean is the run's own), SGLang's
    (`client: sglang`) draws prompts and outputs from U[1, len]; sharegpt: the bundled histogram of
    vLLM's first-turn ShareGPT sampling. Either way the lengths are scaled to the run's token
    totals, which the result block prints."""

    kind: Literal["serving_load"] = "serving_load"
    model: str = Field(..., min_length=1, max_length=500)
    engine: Literal["vllm", "sglang"]
    engine_version: str = Field(..., min_length=1, max_length=40)
    tp: Positive = 1
    pp: Positive = 1
    ep: Positive = 1
    flags: EngineFlags = EngineFlags()
    quantization: Literal["fp8", "int8", "int4", "awq", "gptq"] | None = Field(
        None, description="the served checkpoint's weight format; absent: the model's own dtype")
    client: Literal["vllm", "sglang"] = Field("vllm", description="whose benchmark client sent the requests")
    dataset: Literal["random", "sharegpt"]
    input_len: Positive | None = Field(None, description="random: the prompt length asked for (tokens)")
    output_len: Positive | None = Field(None, description="random: the output length asked for (tokens)")
    num_requests: Annotated[int, Field(gt=0, le=100_000)] = Field(
        ..., description="Successful requests (at most 100,000: each is simulated)")
    total_input_tokens: Annotated[int, Field(ge=1, le=10**11)]
    total_output_tokens: Annotated[int, Field(ge=1, le=10**11)]
    max_concurrency: Positive | None = Field(None, description="the client's cap on requests in flight; absent: none")
    request_rate_per_second: float | None = Field(
        None, gt=0, le=1e6, description="Poisson arrivals at this rate; absent: every request at once (rate inf)")
    measured: ServingLoadMeasured

    @model_validator(mode="after")
    def _lengths(self) -> "ServingLoadCase":
        if self.dataset == "random" and self.client == "sglang" and (self.input_len is None or self.output_len is None):
            raise ValueError("SGLang's random dataset draws lengths up to input_len and output_len: give both")
        return self


def _kind(value: Any) -> Any:
    return value.get("kind") if isinstance(value, dict) else getattr(value, "kind", None)


Case = Annotated[Union[Annotated[EngineLogCase, Tag("engine_log")], Annotated[TrainingCase, Tag("training")],
                       Annotated[FineTuneCase, Tag("finetune")], Annotated[ServingLoadCase, Tag("serving_load")]],
                 Discriminator(_kind, custom_error_type="kind",
                               custom_error_message="kind must be engine_log, training, finetune or serving_load")]


class CaseFile(StrictModel):
    """A `--cases` file: `cases:`, a list of the kinds above."""

    cases: list[Case] = Field(..., min_length=1, max_length=10_000)

    @model_validator(mode="after")
    def _unique(self) -> "CaseFile":
        seen: set[str] = set()
        for c in self.cases:
            if c.id in seen:
                raise ValueError(f"case id {c.id!r} appears twice")
            seen.add(c.id)
        return self


__all__ = ["Case", "CaseFile", "EngineFlags", "EngineLogCase", "FineTuneCase", "ServingLoadCase", "ServingLoadMeasured",
           "TrainingCase", "TrainingMeasured"]
