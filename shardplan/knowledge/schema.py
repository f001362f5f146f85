"""What an engine does, by version: the schema of `knowledge/engines/<engine>.yaml`.

An engine file lists the versions shardplan knows and, per version range ("era"), the rules
that shape serving memory: the profiling pass's size (chunked-prefill rules and defaults by
device), `max_num_seqs` by device, the `gpu_memory_utilization` default, what the budget
counts (the CUDA context, CUDA graphs) and how the engine refuses a `max_model_len` that does
not fit. Every rule carries its source. The cost model never reads versions: `EngineRules`
is resolved once at the input edge into the workload's explicit switches.

Pure: pydantic only (no yaml, rich, typer, torch); `knowledge.load` reads the files.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from shardplan.specs.cases import RecomputeModule

# X.Y[.Z[.W]] with an optional release suffix (0.6.4.post1, 0.9.0.1, 1.2.0rc8, 2.1.0-dev3, 0.5.3+cu124); nothing else
_VERSION = re.compile(r"^v?(\d+)\.(\d+)(?:\.(\d+))?(?:\.\d+)?(?:[.\-]?(?:post|rc|dev|a|b)\d*)?(?:\+[A-Za-z0-9.]+)?$")


_BUILD = re.compile(r"^b(\d+)$")


def parse_version(text: str) -> tuple[int, int, int]:
    """'0.6.4.post1' -> (0, 6, 4); 'v0.8' -> (0, 8, 0); a llama.cpp build tag 'b6500' -> (0, 0, 6500).
    Raises ValueError on anything else."""
    b = _BUILD.match(text.strip())
    if b is not None:
        return 0, 0, int(b.group(1))
    m = _VERSION.match(text.strip())
    if m is None:
        raise ValueError(f"not a version: {text!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)


class DeviceDefault(Frozen):
    """One row of a by-device default; the first row a device matches wins."""

    min_memory_gib: float = Field(0.0, ge=0, description="applies to devices with at least this much memory, GiB")
    exclude_names: tuple[str, ...] = Field((), description="device-name substrings this row excludes (case-insensitive)")
    names: tuple[str, ...] = Field((), description="device-name substrings of which the device must contain one "
                                                   "(case-insensitive); empty: any device")
    min_tp: int = Field(1, ge=1, description="applies to tensor-parallel sizes from this up (SGLang's larger "
                                             "CUDA-graph batch at tp >= 4)")
    value: int = Field(ge=0, description="the default (tokens or sequences: at least 1)")

    def matches(self, memory_gib: float, device_name: str, tp: int = 1) -> bool:
        name = device_name.lower()
        if self.names and not any(x.lower() in name for x in self.names):
            return False
        return (memory_gib >= self.min_memory_gib and tp >= self.min_tp
                and not any(x.lower() in name for x in self.exclude_names))


class TpDefault(Frozen):
    """One row of a by-tensor-parallel-size default; the first row with min_tp <= tp wins."""

    min_tp: int = Field(ge=1, description="applies from this tensor-parallel size up")
    value: float = Field(gt=0, le=1, description="the default")


class CaptureSizeRange(Frozen):
    """One run of capture sizes: start, start + step, ... up to `stop` (inclusive), or up to the
    maximum when `stop` is null (SGLang's range(start, stop + 1, step))."""

    start: int = Field(ge=1, description="first size, tokens")
    stop: int | None = Field(description="last size at most this, tokens (inclusive); null: up to the maximum")
    step: int = Field(ge=1, description="the spacing, tokens")


PrefillGraphOff = Literal["multimodal", "speculative", "pipeline_parallel", "mla", "eager"]


class PrefillGraphReserve(Frozen):
    """SGLang >= 0.5.10: CUDA graphs for prefill (piecewise, from 0.5.15 'breakable' on CUDA) are on
    by default and add to the reserve before its floor: per_capture_size_mib x the number of capture
    sizes (one graph per size, sizes up to the chunked-prefill budget), or a flat mla_mib for an MLA
    model (server_args.py _handle_gpu_memory_settings / arg_groups/memory_hook.py reserve_for_graph_mb).
    `off_for` names the inputs shardplan knows that turn them off by default."""

    per_capture_size_mib: float = Field(ge=0, description="MiB per captured prefill size (non-MLA models)")
    mla_mib: float = Field(ge=0, description="MiB for an MLA model's prefill graphs, whatever their sizes")
    capture_sizes: list[CaptureSizeRange] = Field(
        min_length=1, description="the capture-size list rule: the runs, smallest first; sizes above the maximum "
                                  "(the chunked-prefill budget) are dropped")
    clamped_to_context: bool = Field(
        False, description="the maximum is also at most --context-length when that is given (max_model_len asked for)")
    off_for: list[PrefillGraphOff] = Field(
        default_factory=list, description="what turns them off by default, of what shardplan's inputs know: "
                                          "multimodal (a vision model), speculative (any speculative decoding), "
                                          "pipeline_parallel (pp > 1), mla (an MLA model), eager (--disable-cuda-graph)")

    def sizes_tokens(self, max_tokens: int) -> list[int]:
        """The capture sizes up to `max_tokens` (SGLang _generate_piecewise_cuda_graph_tokens)."""
        sizes: list[int] = []
        for r in self.capture_sizes:
            sizes += range(r.start, (max_tokens if r.stop is None else r.stop) + 1, r.step)
        return [s for s in sizes if s <= max_tokens]

    def reserve_mib(self, *, max_tokens: int, mla: bool) -> float:
        return self.mla_mib if mla else self.per_capture_size_mib * len(self.sizes_tokens(max_tokens))


class ReservedMemory(Frozen):
    """SGLang's default pool fraction from >= 0.5.4 (server_args.py, PR #10975): mem_fraction_static =
    (device MiB - reserved MiB) / device MiB, reserved = base + per_prefill_token x max(chunked prefill,
    min_prefill_tokens) + per_graph_batch x cuda_graph_max_bs + per_rank x tp x pp (+ the prefill CUDA
    graphs' term from 0.5.10), at least `floor_mib` on devices above `floor_above_gib`, then plus the
    speculative draft's reserve (0.5.10 - 0.5.13)."""

    base_mib: float = Field(ge=0, description="fixed reserve, MiB")
    per_prefill_token_mib: float = Field(ge=0, description="MiB per token of the chunked-prefill budget")
    min_prefill_tokens: int = Field(ge=0, description="the budget counted is at least this many tokens")
    per_graph_batch_mib: float = Field(ge=0, description="MiB per sequence of the largest CUDA-graph batch")
    per_rank_mib: float = Field(ge=0, description="MiB per tensor x pipeline rank")
    floor_mib: float = Field(ge=0, description="the reserve's floor on large devices, MiB")
    floor_above_gib: float = Field(ge=0, description="devices above this much memory get the floor, GiB")
    decode_graphs_term_needs_graphs: bool = Field(
        False, description="the per_graph_batch term counts only while decode CUDA graphs are on (false: even with "
                           "--disable-cuda-graph)")
    prefill_graphs: PrefillGraphReserve | None = Field(
        None, description="prefill CUDA graphs on by default and their reserve; null: off by default (before 0.5.10)")
    speculative_after_floor_mib: dict[Literal["draft_model", "mtp", "ngram"], float] = Field(
        default_factory=dict, description="MiB a speculative method's draft adds after the floor, by shardplan's "
                                          "method (draft_model: SGLang's STANDALONE, mtp: NEXTN/EAGLE, ngram: NGRAM); "
                                          "empty: not modelled")

    def fraction(self, device_gib: float, prefill_tokens: int, graph_batch: int, ranks: int, *,
                 prefill_graphs_mib: float = 0.0, speculative_mib: float = 0.0, decode_graphs: bool = True) -> float:
        device_mib = device_gib * 1024
        graphs = self.per_graph_batch_mib * graph_batch if decode_graphs or not self.decode_graphs_term_needs_graphs else 0.0
        reserved = (self.base_mib + self.per_prefill_token_mib * max(prefill_tokens, self.min_prefill_tokens)
                    + graphs + self.per_rank_mib * ranks + prefill_graphs_mib)
        if device_gib > self.floor_above_gib:
            reserved = max(reserved, self.floor_mib)
        reserved += speculative_mib
        return round((device_mib - reserved) / device_mib, 3)


def require_sources(documented: set[str], sources: dict[str, str]) -> None:
    """Every rule a file sets names where it comes from: the fields in `documented` need a source."""
    missing = sorted(documented - {k for k, v in sources.items() if v.strip()})
    if missing:
        raise ValueError(f"no source for {', '.join(missing)}")


def version_in_range(version: tuple[int, int, int], min_version: str, max_version: str | None) -> bool:
    """Whether `version` lies in [min_version, max_version) (None: no upper end)."""
    lo = parse_version(min_version)
    hi = parse_version(max_version) if max_version else None
    return lo <= version and (hi is None or version < hi)


class AdmissionReserve(Frozen):
    """SGLang's admission rule (python/sglang/srt/managers/schedule_policy.py PrefillAdder): the pool must
    hold the new prompt plus ratio x min(max_new_tokens, clip) of its output, with the running
    requests' remaining outputs reserved at the same ratio. The ratio starts at `initial_ratio`,
    falls linearly to initial x `min_ratio_factor` over `decay_steps` decode steps, and returns to
    the start when requests are retracted (scheduler.py update_running_batch)."""

    initial_ratio: float = Field(gt=0, le=1, description="new_token_ratio at start and after a retraction")
    min_ratio_factor: float = Field(gt=0, le=1, description="the floor, as a fraction of initial_ratio")
    decay_steps: int = Field(ge=1, description="decode steps from the start to the floor")
    clip_output_tokens: int = Field(ge=1, description="max_new_tokens is clipped to this in the estimate, tokens")


class EngineEra(Frozen):
    """The rules of one version range, [min_version, max_version)."""

    min_version: str = Field(description="first version the rules hold for (inclusive)")
    max_version: str | None = Field(description="first version they no longer hold for (exclusive); null: still")
    generation: str = Field(description="the engine generation, e.g. 'vLLM V0' or 'vLLM V1'")
    gpu_memory_utilization: float = Field(gt=0, le=1, description="default share of device memory the engine may use")
    block_size: int = Field(ge=1, description="default tokens per KV block")
    max_num_seqs: list[DeviceDefault] = Field(min_length=1, description="default sequences per step, by device")
    chunked_prefill: Literal["always", "above_context", "never"] = Field(
        description="always: chunked prefill is on; above_context: on by default when max_model_len exceeds "
                    "chunked_prefill_above_tokens; never: off unless asked")
    chunked_prefill_above_tokens: int | None = Field(None, ge=1, description="the context length past which it turns on, tokens")
    chunked_budget_tokens: list[DeviceDefault] = Field(min_length=1, description="default max_num_batched_tokens with chunked prefill, by device")
    unchunked_min_tokens: int = Field(ge=1, description="without chunked prefill max_num_batched_tokens defaults to max(max_model_len, this)")
    cuda_context_in_budget: bool = Field(description="the CUDA context counts against total x utilization (no baseline snapshot)")
    cuda_graphs_in_budget: bool = Field(description="CUDA graphs are profiled before the KV cache is sized (else captured after, outside)")
    refusal: Literal["tokens", "bytes", "no_room", "total_tokens"] = Field(
        description="tokens: refuses when max_model_len exceeds the cache's tokens (V0 worker); bytes: when one "
                    "max_model_len sequence's KV bytes exceed the KV memory (V1 check_enough_kv_cache_memory); "
                    "no_room: only when nothing is left for the KV pool (longer requests are refused one by one); "
                    "total_tokens: when max_total_tokens exceeds the cache's tokens (TGI's router)")
    accounting: Literal["profiled", "static_fraction", "warmup", "free_fraction", "fixed_context", "dynamic"] = Field(
        "profiled", description="profiled: budget = device x utilization, minus weights, the profiling pass's peak "
                                "and non-torch memory (vLLM); static_fraction: a pool of (free memory at start) x "
                                "fraction holds weights and KV, activations live outside it (SGLang); warmup: a "
                                "share of the memory free after a warm-up prefill, less what the fraction holds back "
                                "of the device (TGI); free_fraction: the fraction of the memory free after the "
                                "weights and the activation peak (TensorRT-LLM); fixed_context: a KV cache of exactly "
                                "the context asked for, beside the weights and a compute buffer (llama.cpp); dynamic: "
                                "no pool, the KV cache grows with the batch (transformers generate)")
    static_fraction_by_tp: list[TpDefault] | None = Field(
        None, description="static_fraction: the default fraction by tensor-parallel size, largest min_tp first")
    static_fraction_reserved: ReservedMemory | None = Field(
        None, description="static_fraction: the default fraction from a reserve rule instead of a by-tp table")
    non_torch_gib: float | None = Field(
        None, ge=0, description="non-torch memory the profiling pass adds beyond the CUDA context and NCCL, GiB; "
                                "null: the hardware profile's figure")
    unchunked_extra_tokens: int = Field(
        0, ge=0, description="without chunked prefill the pass holds max_model_len + this many tokens (TGI: "
                             "max_input_tokens + 50)")
    max_model_len_cap: int | None = Field(
        None, ge=1, description="the default max_model_len is min(the model's context, this); null: the model's")
    warmup_free_share: float = Field(1.0, gt=0, le=1, description="warmup: the share of the free memory sized as KV")
    warmup_total_factor: float = Field(
        1.0, gt=0, le=1, description="warmup: the device share held back is 1 - fraction x this (TGI >= 3.0's wiggle room)")
    warmup_batch: Literal["none", "prefill", "requests_at_max_len"] = Field(
        "none", description="warmup: the KV blocks of the warm-up batch, counted back into the cache: none; prefill "
                            "(one request of the prefill's tokens); requests_at_max_len (requests of max_model_len - 1 "
                            "prompt tokens filling the prefill, each reserving max_model_len)")
    prefill_logit_bytes: float = Field(
        0.0, ge=0, description="bytes per logit the profiling prefill holds for every one of its tokens (TGI's "
                               "warm-up asks for prompt log-probabilities); 0: logits of the last tokens only")
    prefill_logit_bytes_gathered: float = Field(
        0.0, ge=0, description="the same where the lm_head is split over the tensor-parallel ranks and its logits "
                               "gathered (the vocabulary divides evenly); 0: as prefill_logit_bytes")
    attention_workspace_mib: float = Field(
        0.0, ge=0, description="warmup: a buffer the attention backend allocates in the warm-up prefill and keeps, MiB")
    sampler_bytes_per_logit: float = Field(
        ge=0, description="bytes per (row, vocabulary entry) the profiling pass's dummy sampler run holds at its "
                          "peak, by the engine's default sampling path (0: no dummy sampler run)")
    python_ops_per_layer: float = Field(
        ge=0, description="framework ops one decoder layer issues from Python in eager mode (counted in the "
                          "engine's model, layer and attention-backend code); 0: a C++ runtime")
    python_ops_per_layer_parts: dict[Literal[
            "norms", "attention", "qk_norm", "mla_attention", "dense_mlp", "moe", "per_fp8_block_linear",
            "per_all_reduce"], float] | None = Field(
        None, description="framework ops of an eager decoder layer by part, where they differ by architecture: "
                          "norms; attention (GQA/MHA with rotary) or mla_attention (MLA); qk_norm (per-head q/k "
                          "norms); dense_mlp (also each shared expert) or moe (router, top-k, fused experts); "
                          "per_fp8_block_linear (extra ops of a block-quantized FP8 linear: activation "
                          "quantization and the block GEMM); per_all_reduce (each tensor-parallel all-reduce). "
                          "null: python_ops_per_layer for every layer")
    python_ops_per_step: float = Field(
        ge=0, description="framework ops per step outside the decoder layers that run eagerly even with CUDA "
                          "graphs (logits, sampler)")
    step_overhead_us: float = Field(
        ge=0, description="host work per step that the GPU waits for (scheduling, input preparation, output "
                          "processing), microseconds, measured where the device time is negligible")
    cuda_graph_max_batch: list[DeviceDefault] = Field(
        min_length=1, description="decode steps of up to this many sequences replay a CUDA graph by default, by "
                                  "device; 0: the engine captures none")
    cuda_graph_max_batch_capped: bool = Field(
        False, description="the default is at most max_num_seqs when that is given (SGLang >= 0.5.22: decode "
                           "max_bs <= --max-running-requests)")
    schedule: Literal["mixed", "prefill_first", "static"] = Field(
        description="how the scheduler composes a step under continuous batching (cost/serving_load.py): mixed: "
                    "the running requests' decode tokens first, then prompt chunks of running and waiting requests "
                    "fill the token budget, in one forward; prefill_first: a step of prompt tokens alone whenever a "
                    "waiting request can be admitted, decode steps otherwise; static: one batch runs to its end "
                    "before the next is admitted (no continuous batching). Without chunked prefill every engine "
                    "prefills whole prompts first (vLLM V0 _schedule_default)")
    graphs_for_prompt_steps: bool = Field(
        False, description="steps that carry prompt tokens replay CUDA graphs up to cuda_graph_max_batch tokens "
                           "(vLLM V1's piecewise graphs around attention); false: only decode steps do")
    admission: AdmissionReserve | None = Field(
        None, description="a waiting request is admitted only if the KV pool holds its prompt plus a reserve for "
                          "the outputs of it and of the running requests (SGLang's new_token_ratio); null: admitted "
                          "while the pool holds its prompt chunk (vLLM), preempting when decodes run out")
    admit_after_preemption: bool = Field(
        True, description="a step that preempted a running request still admits waiting ones (vLLM V0 "
                          "_schedule_chunked_prefill schedules new prefills after preemptions); false: it admits "
                          "none until a step runs without preempting (vLLM V1 Scheduler.schedule)")
    batches_in_flight: int = Field(
        1, ge=1, le=2, description="when the scheduler forms a step's batch: 1, when the step before it ends; 2, while "
                                   "the step before it runs (SGLang's overlap scheduler, vLLM's async scheduling, "
                                   "TensorRT-LLM's overlap scheduler), so a request that arrives during a step waits for "
                                   "the batch already formed too (cost/serving_load.py)")
    batches_in_flight_pp1_only: bool = Field(
        False, description="the engine forms one batch at a time under pipeline parallelism (vLLM turns async "
                           "scheduling off when pp > 1)")
    batches_in_flight_speculative: list[Literal["draft_model", "mtp", "ngram"]] | None = Field(
        None, description="the speculative methods it still forms batches ahead with; another one makes it form one "
                          "batch at a time (vLLM's async scheduling takes EAGLE and MTP only); null: every method")
    hybrid_kv_cache: bool = Field(
        False, description="the engine caches a model's sliding-window layers apart, each only for its window: vLLM "
                           "V1's hybrid KV cache manager (full-attention and sliding-window layers form KV cache groups "
                           "of equal size drawing blocks from one pool, a sliding-window group holding only the "
                           "window's blocks per request; docs/research/vllm-hybrid-kv.md), llama.cpp's iSWA cache (a "
                           "second cache of n_swa x sequences + n_ubatch cells for the sliding layers); false: every "
                           "attention layer of a model that mixes them holds the whole sequence")
    kv_tokens_reported: Literal["blocks", "concurrency"] = Field(
        "blocks", description="what 'GPU KV cache size: N tokens' counts: blocks: the pool's blocks per KV cache group "
                              "x block_size; concurrency: int(max concurrency x max_model_len) (vLLM >= 0.20.1)")
    sliding_window_in_flight_batches: int = Field(
        1, ge=1, description="batches of max_num_batched_tokens a sliding-window KV cache group holds per request "
                             "beyond its window - 1 tokens, at one pipeline stage (vLLM SlidingWindowSpec."
                             "max_memory_usage_bytes, which sizes the pool, the concurrency it logs and the start-up "
                             "check): 1: one chunk (vLLM < 0.26); 2: VllmConfig.max_in_flight_tokens = "
                             "max_concurrent_batches x max_num_batched_tokens with async scheduling, the default, "
                             "overlapping two batches (vLLM >= 0.26)")
    sources: dict[str, str] = Field(description="field -> where the rule comes from (file at a tag, PR, release note)")

    @model_validator(mode="after")
    def _check(self) -> "EngineEra":
        parse_version(self.min_version)
        if self.max_version is not None and parse_version(self.max_version) <= parse_version(self.min_version):
            raise ValueError(f"max_version {self.max_version} is not after min_version {self.min_version}")
        for name in ("max_num_seqs", "chunked_budget_tokens"):
            if any(r.value < 1 for r in getattr(self, name)):
                raise ValueError(f"{name} defaults must be at least 1")
        if self.chunked_prefill == "above_context" and self.chunked_prefill_above_tokens is None:
            raise ValueError("chunked_prefill: above_context needs chunked_prefill_above_tokens")
        documented = {"generation", "gpu_memory_utilization", "block_size", "max_num_seqs", "chunked_prefill",
                      "chunked_budget_tokens", "unchunked_min_tokens", "cuda_context_in_budget",
                      "cuda_graphs_in_budget", "refusal", "python_ops_per_layer", "python_ops_per_step",
                      "cuda_graph_max_batch", "step_overhead_us", "sampler_bytes_per_logit", "schedule"}
        if self.graphs_for_prompt_steps:
            documented.add("graphs_for_prompt_steps")
        if self.cuda_graph_max_batch_capped:
            documented.add("cuda_graph_max_batch_capped")
        if self.admission is not None:
            documented.add("admission")
        if not self.admit_after_preemption:
            documented.add("admit_after_preemption")
        if self.batches_in_flight != 1:
            documented.add("batches_in_flight")
        if self.batches_in_flight_pp1_only:
            documented.add("batches_in_flight_pp1_only")
        if self.batches_in_flight_speculative is not None:
            documented.add("batches_in_flight_speculative")
        if self.hybrid_kv_cache:
            documented.add("hybrid_kv_cache")
        if self.kv_tokens_reported != "blocks":
            documented.add("kv_tokens_reported")
        if self.sliding_window_in_flight_batches != 1:
            documented.add("sliding_window_in_flight_batches")
        if self.python_ops_per_layer_parts is not None:
            documented.add("python_ops_per_layer_parts")
            if any(v < 0 for v in self.python_ops_per_layer_parts.values()):
                raise ValueError("python_ops_per_layer_parts: op counts must be >= 0")
        if self.accounting == "static_fraction":
            if self.static_fraction_reserved is not None:
                documented |= {"accounting", "static_fraction_reserved"}
            elif not self.static_fraction_by_tp or min(r.min_tp for r in self.static_fraction_by_tp) != 1:
                raise ValueError("accounting: static_fraction needs static_fraction_by_tp with a min_tp: 1 row "
                                 "(or static_fraction_reserved)")
            else:
                documented |= {"accounting", "static_fraction_by_tp"}
        if self.accounting == "warmup":
            documented |= {"accounting", "warmup_free_share", "warmup_total_factor", "warmup_batch",
                           "prefill_logit_bytes", "prefill_logit_bytes_gathered"}
            if self.attention_workspace_mib:
                documented.add("attention_workspace_mib")
        if self.accounting == "free_fraction":
            documented |= {"accounting"}
        for optional in ("non_torch_gib", "max_model_len_cap"):
            if getattr(self, optional) is not None:
                documented.add(optional)
        if self.unchunked_extra_tokens:
            documented.add("unchunked_extra_tokens")
        require_sources(documented, self.sources)
        return self

    def holds_for(self, version: tuple[int, int, int]) -> bool:
        return version_in_range(version, self.min_version, self.max_version)


class MultimodalEra(Frozen):
    """How one version range, [min_version, max_version), profiles a multimodal model's vision
    encoder before sizing the KV cache (docs/research/vllm-multimodal-profiling.md has the lines)."""

    min_version: str = Field(description="first version the rules hold for (inclusive)")
    max_version: str | None = Field(description="first version they no longer hold for (exclusive); null: still")
    profile: Literal["sequences", "encoder_budget"] = Field(
        description="sequences: the text pass's dummy sequences carry the items, max(1, min(max_num_seqs, "
                    "max_num_batched_tokens // (items x tokens per item))) of them (V0); encoder_budget: the "
                    "encoder runs apart on max(max_num_batched_tokens, tokens per item) tokens of items (V1)")
    items_per_prompt: int = Field(ge=1, description="default limit_mm_per_prompt of a modality")
    min_batched_tokens: int = Field(0, ge=0, description="a multimodal model's default max_num_batched_tokens is at "
                                                         "least this (tokens); 0: no floor")
    text_only_when_longer: bool = Field(
        False, description="sequences: a dummy sequence too short for its items' tokens profiles text only")
    items_rounding: Literal["ceil", "floor"] = Field(
        "floor", description="encoder_budget: items = budget / tokens per item, rounded so")
    items_capped_by_context: bool = Field(
        False, description="encoder_budget: at most max_num_seqs x max(1, min(limit, max_model_len // tokens per item)) "
                           "items (else max_num_seqs x limit)")
    outputs_kept: bool = Field(False, description="encoder_budget: the encoder outputs stay alive during the text pass")
    outputs_padded_to_budget: bool = Field(
        False, description="encoder_budget: each kept output is padded to the whole budget's rows")
    sources: dict[str, str] = Field(description="field -> where the rule comes from")

    @model_validator(mode="after")
    def _check(self) -> "MultimodalEra":
        parse_version(self.min_version)
        documented = {"profile", "items_per_prompt"}
        for name in ("min_batched_tokens", "text_only_when_longer", "outputs_kept", "outputs_padded_to_budget",
                     "items_capped_by_context"):
            if getattr(self, name):
                documented.add(name)
        if self.profile == "encoder_budget":
            documented.add("items_rounding")
        require_sources(documented, self.sources)
        return self

    def holds_for(self, version: tuple[int, int, int]) -> bool:
        return version_in_range(version, self.min_version, self.max_version)


class OffloadEra(Frozen):
    """How one version range, [min_version, max_version), runs a model whose weights do not all
    fit on the GPU (docs/research has no file: each rule carries its source line here)."""

    min_version: str = Field(description="first version the rules hold for (inclusive)")
    max_version: str | None = Field(description="first version they no longer hold for (exclusive); null: still")
    mode: Literal["stream", "host_compute"] = Field(
        description="stream: the offloaded layers' weights are copied to the GPU for every forward (accelerate's "
                    "hooks, vLLM --cpu-offload-gb); host_compute: the offloaded layers run on the CPU where they live "
                    "(llama.cpp -ngl)")
    gpu_layers: Literal["first", "last"] = Field(
        description="which decoder layers stay on the GPU: the first (offload takes the last) or the last")
    targets: list[Literal["cpu", "nvme"]] = Field(min_length=1, description="where weights may be offloaded")
    overlap: bool = Field(False, description="stream: the next layer's copy overlaps this layer's compute (prefetch)")
    embedding_on_host: bool = Field(False, description="the token embedding always stays in host memory")
    kv_with_layer: bool = Field(False, description="host_compute: an offloaded layer's KV cache lives in host memory")
    batch_on_gpu_min_tokens: int = Field(
        0, ge=0, description="host_compute: a batch of at least this many tokens runs the offloaded layers' matrix "
                             "multiplications on the GPU, copying their weights over (0: never)")
    pinned: bool = Field(
        True, description="stream: the host copies are in pinned (page-locked) memory; false: pageable, which the "
                          "driver stages through a pinned buffer at a lower rate (the profile's host_link_pageable)")
    keeps_quantization: bool = Field(
        True, description="offloaded layers keep the plan's weight format (false: they are held unquantized)")
    stream_unit: Literal["layer", "tensor"] = Field(
        "layer", description="stream: what one copy brings to the GPU at a time (a whole layer, or one tensor)")
    option: str = Field(description="the engine's option for it, as printed in assumptions")
    sources: dict[str, str] = Field(description="field -> where the rule comes from")

    @model_validator(mode="after")
    def _check(self) -> "OffloadEra":
        parse_version(self.min_version)
        documented = {"mode", "gpu_layers", "targets"}
        for name in ("overlap", "embedding_on_host", "kv_with_layer", "batch_on_gpu_min_tokens"):
            if getattr(self, name):
                documented.add(name)
        if not self.keeps_quantization:
            documented.add("keeps_quantization")
        if self.mode == "stream":
            documented.add("pinned")
        if self.mode == "stream":
            documented.add("stream_unit")
        require_sources(documented, self.sources)
        return self

    def holds_for(self, version: tuple[int, int, int]) -> bool:
        return version_in_range(version, self.min_version, self.max_version)


class CheckpointFormat(BaseModel):
    """A weight format a checkpoint ships in that the engine runs as it is (no --quantization)."""

    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)

    format: Literal["mxfp4", "fp8", "awq", "gptq", "ct-fp8", "ct-int8", "ct-w4a16"] = Field(
        description="shardplan's name for it (--quantization): mxfp4, gpt-oss's routed experts; fp8, a block-quantized "
                    "FP8 checkpoint's linear weights (quantization_config quant_method fp8 with a weight_block_size: "
                    "DeepSeek-V3/R1, Qwen3 FP8 releases); awq and gptq, a 4-bit AWQ or GPTQ checkpoint's linear "
                    "weights (quant_method awq or gptq, bits 4); ct-fp8, ct-int8 and ct-w4a16, an llm-compressor "
                    "compressed-tensors checkpoint's FP8, INT8 W8A8 or 4-bit W4A16 weights (planned as fp8, int8, "
                    "int4: specs/model.py CHECKPOINT_KINDS)")
    min_version: str = Field(description="first release that runs it")
    source: str = Field(description="where the support and its first release come from")
    without_fp4_tensor_cores: Literal["mxfp4_marlin"] | None = Field(
        None, description="the layout it holds the weights in on GPUs without FP4 tensor cores (the profile has no fp4 "
                          "peak); null: as shipped")
    without_fp4_tensor_cores_source: str = Field("", description="where that layout comes from, with what it was "
                                                                 "measured against")
    needs_fp8_tensor_cores: bool = Field(False, description="planned as shipped only on GPUs with FP8 tensor cores (the "
                                                            "profile has an fp8 peak); elsewhere the model's own dtype")
    needs_fp8_tensor_cores_source: str = Field("", description="why, with its source")
    architectures: list[str] | None = Field(
        None, description="the GPU architectures (the hardware profile's gpu.architecture) its kernels run on; "
                          "elsewhere, or on a profile that states none, the model's own dtype. null: any")
    architectures_source: str = Field("", description="where that list comes from")
    refused_architectures: list[str] = Field(
        default_factory=list, description="GPU architectures the engine's kernels for this format do not run on at all "
                                          "(a plan in it, asked for with --quantization or --allow-quantization, is "
                                          "refused there); an architecture in neither list is not established")
    refused_architectures_source: str = Field("", description="where that list comes from")

    @model_validator(mode="after")
    def _check(self) -> "CheckpointFormat":
        parse_version(self.min_version)
        if self.without_fp4_tensor_cores is not None and not self.without_fp4_tensor_cores_source:
            raise ValueError("without_fp4_tensor_cores needs without_fp4_tensor_cores_source")
        if self.needs_fp8_tensor_cores and not self.needs_fp8_tensor_cores_source:
            raise ValueError("needs_fp8_tensor_cores needs needs_fp8_tensor_cores_source")
        if self.architectures is not None and not self.architectures_source:
            raise ValueError("architectures needs architectures_source")
        if self.refused_architectures and not self.refused_architectures_source:
            raise ValueError("refused_architectures needs refused_architectures_source")
        return self

    def runs_on(self, architecture: str | None) -> bool:
        """Whether its kernels run on a GPU of `architecture` (None: a profile that states none)."""
        return self.architectures is None or architecture in self.architectures


class Fp8Marlin(Frozen):
    """GPU architectures on which the engine multiplies FP8 weights through Marlin (weight-only) even
    though they have FP8 tensor cores, from a release on (TGI on Ada); everywhere the engines use
    Marlin for FP8 on GPUs without FP8 tensor cores."""

    architectures: list[str] = Field(min_length=1, description="the hardware profile's gpu.architecture names")
    min_version: str = Field(description="first release that does")
    source: str = Field(min_length=1, description="where it comes from")

    @model_validator(mode="after")
    def _check(self) -> "Fp8Marlin":
        parse_version(self.min_version)
        return self


class OverlapSwitch(BaseModel):
    """The command-line flag that turns the engine's overlap of scheduling with the GPU on or off
    (EngineEra.batches_in_flight), from the release that has it."""

    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)

    on_flag: str | None = Field(description="the flag that turns it on (vLLM --async-scheduling); null: none does")
    off_flag: str = Field(description="the flag that turns it off")
    min_version: str = Field(description="first release with the switch")
    source: str = Field(description="where the flags and their first release come from")

    @model_validator(mode="after")
    def _check(self) -> "OverlapSwitch":
        parse_version(self.min_version)
        return self


class EngineFile(Frozen):
    """`knowledge/engines/<engine>.yaml`."""

    engine: str = Field(description="the name users pass to --engine")
    display_name: str = Field(description="how output names it")
    versions: list[str] = Field(min_length=1, description="released versions shardplan knows, oldest first")
    fraction_name: str = Field("gpu_memory_utilization", description="the engine's name for the share of device "
                                                                     "memory it may use (its command-line flag)")
    eras: list[EngineEra] = Field(min_length=1, description="rules by version range, oldest first")
    multimodal_eras: list[MultimodalEra] = Field(
        default_factory=list, description="how each version range profiles a vision encoder; none: not modelled")
    offload_eras: list[OffloadEra] = Field(
        default_factory=list, description="how each version range runs weights held off the GPU; none: it cannot")
    weight_formats: list[str] = Field(
        default_factory=lambda: ["fp8", "int8", "int4", "awq", "gptq"],
        description="quantized weight formats the engine loads (shardplan's --quantization names), searched when "
                    "nothing fits otherwise")
    weight_formats_source: str = Field("", description="where the list comes from")
    checkpoint_formats: list[CheckpointFormat] = Field(
        default_factory=list, description="formats a checkpoint ships in that the engine runs as they are, from a "
                                          "version on (gpt-oss's MXFP4 experts); a model in one is planned in it")
    overlap_switch: OverlapSwitch | None = Field(
        None, description="the flags that set whether it forms the next batch while a step runs; none: it has none")
    kv_block_formats: list[Literal["q8_0", "q4_0"]] = Field(
        default_factory=list, description="ggml block formats its KV cache takes (--kv-cache-dtype q8_0|q4_0); "
                                          "none: only the float formats")
    kv_block_formats_source: str = Field("", description="where the list, and any condition on it, comes from")
    kv_heads_copied: bool = Field(
        True, description="where tensor parallelism exceeds the model's KV heads, the engine copies each KV head to the "
                          "ranks that need it (vLLM, SGLang); false: every rank needs whole KV heads of its own, so tp "
                          "must divide the KV heads")
    kv_heads_copied_source: str = Field("", description="where a false comes from")
    speculative_with_pp: bool = Field(
        True, description="speculative decoding runs with pipeline parallelism; false: the engine refuses to start "
                          "the two together (SGLang's server_args)")
    speculative_with_pp_source: str = Field("", description="where a false comes from")
    fp8_marlin: Fp8Marlin | None = Field(
        None, description="architectures with FP8 tensor cores on which it still runs FP8 weights through Marlin; "
                          "none: only those without")

    @model_validator(mode="after")
    def _cover(self) -> "EngineFile":
        if self.kv_block_formats and not self.kv_block_formats_source:
            raise ValueError("kv_block_formats needs kv_block_formats_source")
        if not self.kv_heads_copied and not self.kv_heads_copied_source:
            raise ValueError("kv_heads_copied false needs kv_heads_copied_source")
        if not self.speculative_with_pp and not self.speculative_with_pp_source:
            raise ValueError("speculative_with_pp false needs speculative_with_pp_source")
        for v in self.versions:
            n = sum(era.holds_for(parse_version(v)) for era in self.eras)
            if n != 1:
                raise ValueError(f"version {v} is covered by {n} eras; every known version needs exactly one")
        return self

    @property
    def newest(self) -> str:
        return max(self.versions, key=parse_version)


class EngineRules(Frozen):
    """One engine at one version: what the cost model's inputs are resolved from."""

    engine: str
    display_name: str
    version: str
    era: EngineEra

    fraction_name: str = "gpu_memory_utilization"  # what the engine calls the share of memory it may use
    multimodal: MultimodalEra | None = None  # how it profiles a vision encoder; None: not modelled for it
    offload: OffloadEra | None = None  # how it runs offloaded weights; None: it cannot offload
    weight_formats: tuple[str, ...] = ("fp8", "int8", "int4", "awq", "gptq")  # quantized formats it loads
    checkpoint_formats: tuple[CheckpointFormat, ...] = ()  # formats it runs as a checkpoint ships them, at this version
    kv_block_formats: tuple[str, ...] = ()  # ggml block formats its KV cache takes (llama.cpp: q8_0, q4_0)
    overlap_switch: OverlapSwitch | None = None  # its flags for overlap scheduling, where this version has them
    kv_block_formats_source: str = ""  # the rule, with its source, printed as an assumption when one is used
    kv_heads_copied: bool = True  # False: tp must divide the KV heads (EngineFile.kv_heads_copied)
    speculative_with_pp: bool = True  # False: it refuses speculative decoding with pp > 1
    fp8_marlin_architectures: tuple[str, ...] = ()  # with FP8 tensor cores, yet FP8 through Marlin (EngineFile.fp8_marlin)

    @property
    def label(self) -> str:
        return f"{self.display_name} {self.version}"

    def by_device(self, table: list[DeviceDefault], memory_gib: float, device_name: str, tp: int = 1) -> int:
        for row in table:
            if row.matches(memory_gib, device_name, tp):
                return row.value
        return table[-1].value


__all__ = ["CaptureSizeRange", "DeviceDefault", "EngineEra", "EngineFile", "EngineRules", "MultimodalEra", "OffloadEra",
           "OverlapSwitch",
           "PrefillGraphReserve", "ReservedMemory", "TpDefault",
           "parse_version"]


class EagerElementwise(Frozen):
    """Forward memory traffic of a stack's eager elementwise ops, counted from its model code:
    bytes per element at 16-bit activations (every read and write of every op, upcasts
    included) and the kernels launched."""

    norm_bytes_per_element: float = Field(gt=0, le=1000, description="one RMSNorm, per hidden element (LayerNorm is "
                                                                    "one native kernel even in eager mode)")
    norm_kernels: int = Field(ge=1, le=100)
    rope_bytes_per_element: float = Field(gt=0, le=1000, description="rotary embedding, per element of q (and of k)")
    rope_kernels: int = Field(ge=1, le=100, description="kernels for q and k together")
    act_bytes_per_element: float = Field(gt=0, le=1000, description="the gated MLP activation (SwiGLU), per "
                                                                   "intermediate element")
    act_kernels: int = Field(ge=1, le=100)


class CompiledLoss(Frozen):
    """The loss head once torch.compile fuses it (the upcast and log-softmax never materialised)."""

    bytes_per_logit: float = Field(gt=0, le=100, description="bytes per logit at the loss head's peak")
    largest_allocation_bytes_per_logit: float = Field(gt=0, le=100, description="its largest tensor, bytes per logit")
    forward_bytes_per_logit: float = Field(ge=0, le=1000, description="forward memory traffic, bytes per logit")
    backward_bytes_per_logit: float = Field(ge=0, le=1000, description="backward memory traffic, bytes per logit")


class FineTuneRules(Frozen):
    """What the stack offers for parameter-efficient fine-tuning (cost/finetune.py)."""

    offered: list[Literal["full", "lora", "qlora"]] = Field(min_length=1, description="the fine-tuning methods it runs")
    qlora_fp32_non_quantized: bool = Field(
        False, description="under qlora the base's non-quantized parameters (embeddings, norms, lm_head) are cast "
                           "to fp32 (PEFT prepare_model_for_kbit_training)")


class OptimizerDtypes(Frozen):
    """The dtypes the stack's optimizer can keep its own copies in (--master-dtype, --moment-dtype,
    --grad-reduce-dtype)."""

    master: list[Literal["fp32", "bf16"]] = Field(["fp32"], min_length=1,
                                                  description="its master weights (with the gradients it accumulates into)")
    moments: list[Literal["fp32", "bf16"]] = Field(["fp32"], min_length=1, description="Adam's moments")
    grads: list[Literal["fp32", "bf16"]] = Field(["fp32"], min_length=1, description="the main gradients it reads, "
                                                 "where they are a buffer of their own (--grad-reduce-dtype; Megatron-"
                                                 "Core's grad_reduce_in_fp32); fp32 alone: not an option of the stack")
    paired: bool = Field(False, description="the moments take the master's dtype (torch.optim makes its states like "
                                            "the parameter it steps): the two options go together")


class StackFile(Frozen):
    """`knowledge/stacks/<stack>.yaml`: what a training stack does that moves memory and time.
    Every field has its source in `sources` (the schema refuses one without)."""

    stack: str = Field(description="the name users pass to --stack")
    display_name: str = Field(description="how output names it")
    framework: Literal["zero", "deepspeed", "megatron"] = Field(
        description="whose bookkeeping of model states it follows (cost.workload.Framework)")
    loss_bytes_per_logit: float = Field(
        gt=0, description="bytes per logit the loss head holds at its peak (the start of backward): bf16 logits, "
                          "fp32 upcast, fp32 log-softmax, fp32 gradients, as the stack's loss code keeps them")
    loss_vocab_parallel: bool = Field(description="the logits stay split over tensor-parallel ranks (vocab-parallel "
                                                  "or loss-parallel cross-entropy); false: each rank holds all")
    loss_parallel_bytes_per_logit: float | None = Field(
        None, gt=0, le=100, description="with tensor parallelism, bytes per local logit the loss-parallel "
                                        "cross-entropy holds at its peak, where its code differs from the dense loss; "
                                        "null: loss_bytes_per_logit")
    largest_allocation_bytes_per_logit: float = Field(
        gt=0, description="the loss head's largest single tensor, bytes per logit (the fp32 logits): the caching "
                          "allocator needs a fresh block of that size at the peak")
    recompute: list[Literal["none", "selective", "full"]] = Field(min_length=1, description="checkpointing it offers")
    selective: Literal["attention_core", "op_level"] | None = Field(
        description="what --recompute selective means: attention_core (Megatron: softmax, dropout and scores x V "
                    "recomputed) or op_level (PyTorch selective checkpointing: matmul and attention outputs saved, "
                    "every second matmul output dropped, elementwise ops recomputed); null: not offered")
    attention: Literal["flash", "sdpa", "eager"] = Field(description="its default attention kernel")
    amp_fp32_master: bool = Field(description="weights held in fp32 under bf16 autocast: bf16 copies of each "
                                              "layer's weights are cached for the forward and saved for backward")
    norms_fp32: bool = Field(description="norms compute in fp32 (autocast/HF RMSNorm): they save fp32 copies")
    elementwise_fused: bool = Field(description="norms, RoPE and SwiGLU run as fused kernels (else eager, unfused)")
    eager_elementwise: EagerElementwise | None = Field(
        description="the traffic of its unfused elementwise ops; required unless elementwise_fused")
    compile_offered: bool = Field(description="torch.compile can fuse its elementwise ops (--compile)")
    eager_attention_bytes_per_score: float = Field(
        gt=0, le=1000, description="unfused attention's forward memory traffic per score element at 16-bit "
                                   "activations, dropout included (its 5 bytes come off without dropout)")
    attention_kernels: list[Literal["fa2", "fa3", "cudnn"]] = Field(
        description="the fused attention kernels it runs, in its order of preference (the first the GPU profile "
                    "measured is used); empty: eager attention")
    loss_forward_bytes_per_logit: float = Field(ge=0, le=1000, description="the loss head's forward memory traffic "
                                                                         "(upcast, log-softmax), bytes per logit")
    loss_backward_bytes_per_logit: float = Field(ge=0, le=1000, description="its backward traffic (gradient of the "
                                                                          "log-softmax, downcast), bytes per logit")
    pp_holds_stage_outputs: bool = Field(
        False, description="its pipeline runtime keeps each stage's output per micro-batch in flight until that "
                           "micro-batch's backward, and one more (torch.distributed.pipelining); false: the output's "
                           "memory is released once sent (Megatron's deallocate_output_tensor)")
    fsdp_unsharded_under_pp: bool = Field(
        description="with pipeline parallelism, FSDP keeps each stage's parameters unsharded (bf16) and accumulates "
                    "unsharded fp32 gradients across micro-batches, resharding only after the last")
    compiled_loss: CompiledLoss | None = Field(
        None, description="with --compile the loss is compiled too (torchtitan since 2025-04); null: it is not")
    tp_comm_overlap_offered: bool = Field(
        description="it can run tensor-parallel collectives beside the GEMMs (--tp-comm-overlap)")
    pp_p2p_overlap: bool = Field(description="under the interleaved schedule its pipeline sends overlap compute")
    collectives_multirail: bool = Field(
        description="its data-parallel and tensor/expert collectives across nodes reach the NICs of all the group's "
                    "ranks in a node (NCCL multi-rail); false: each rank's own NIC")
    finetune: FineTuneRules = Field(description="the fine-tuning methods it offers and how it holds a frozen base")
    ddp_gradient_buckets: bool = Field(
        False, description="over data-parallel ranks without sharding (ZeRO 0) it runs torch's DDP, whose reducer "
                           "keeps a bucket copy of every gradient from its construction on (gradient_as_bucket_view "
                           "False, the default)")
    grads_allocated_in_backward: bool = Field(
        False, description="its loop sets the gradients to None after each step (zero_grad(set_to_none=True)), so a "
                           "step of one micro-batch allocates each gradient in backward as the activations are freed; "
                           "false: they persist in a buffer (Megatron's main_grad, DeepSpeed's partitions)")
    zero_reduce_bucket_elements: int = Field(
        0, ge=0, le=10**11, description="ZeRO's contiguous gradient bucket (DeepSpeed zero_optimization."
        "reduce_bucket_size, elements in the 16-bit gradients' dtype): kept whole on every rank at stages 1-3, twice at "
        "stages 1-2 with overlap_comm; 0: the stack keeps none")
    hf_model_code: bool = Field(
        False, description="it trains transformers' own modeling code, so unfused attention is transformers' eager "
                           "attention (its softmax dtype per family: knowledge/model_support.py); false: the stack's "
                           "own attention")
    optimizer_foreach: bool = Field(
        False, description="its default AdamW is torch's foreach implementation, whose step allocates a list the size "
                           "of the rank's optimizer states' parameters (the square roots of exp_avg_sq) at once; "
                           "false: a fused kernel that allocates none")
    optimizer_dtypes: OptimizerDtypes = Field(
        default_factory=OptimizerDtypes, description="the dtypes its optimizer's master weights and moments can take; "
                                                     "absent: fp32 only")
    moe_expert_outputs_saved: bool = Field(
        True, description="an MoE layer keeps its routed experts' outputs (tokens x top-k x hidden) for the router "
                          "probabilities' gradient (the probabilities multiply the outputs); false: they multiply inside "
                          "the experts' activation, whose saved input serves their gradient")
    fp8_saves_quantized_inputs: bool = Field(
        False, description="under fp8 GEMMs a linear saves the fp8 copy of its input for the weight gradient (1 byte "
                           "an element); false: the 16-bit input")
    recompute_modules: list[RecomputeModule] = Field(
        default_factory=list, description="the submodules --recompute-modules can name under selective "
                                          "recomputation; empty: its selective policy is fixed")
    recompute_modules_default: list[RecomputeModule] = Field(
        default_factory=list, description="what selective recomputation recomputes when --recompute-modules is not given")
    sources: dict[str, str] = Field(description="field -> where it comes from (file at a tag, PR, doc)")

    @model_validator(mode="after")
    def _check(self) -> "StackFile":
        documented = {"framework", "loss_bytes_per_logit", "loss_vocab_parallel", "largest_allocation_bytes_per_logit",
                      "recompute", "selective", "attention", "amp_fp32_master", "norms_fp32", "elementwise_fused",
                      "compile_offered", "attention_kernels", "loss_forward_bytes_per_logit",
                      "loss_backward_bytes_per_logit", "fsdp_unsharded_under_pp", "tp_comm_overlap_offered",
                      "pp_p2p_overlap", "collectives_multirail", "eager_attention_bytes_per_score", "finetune"}
        if self.eager_elementwise is not None:
            documented.add("eager_elementwise")
        if self.compiled_loss is not None:
            documented.add("compiled_loss")
        if self.loss_parallel_bytes_per_logit is not None:
            documented.add("loss_parallel_bytes_per_logit")
        if self.pp_holds_stage_outputs:
            documented.add("pp_holds_stage_outputs")
        if self.optimizer_dtypes != OptimizerDtypes():
            documented.add("optimizer_dtypes")
        if self.optimizer_foreach:
            documented.add("optimizer_foreach")
        if self.hf_model_code:
            documented.add("hf_model_code")
        if self.zero_reduce_bucket_elements:
            documented.add("zero_reduce_bucket_elements")
        if self.grads_allocated_in_backward:
            documented.add("grads_allocated_in_backward")
        if self.ddp_gradient_buckets:
            documented.add("ddp_gradient_buckets")
        if not self.moe_expert_outputs_saved:
            documented.add("moe_expert_outputs_saved")
        if self.fp8_saves_quantized_inputs:
            documented.add("fp8_saves_quantized_inputs")
        if self.recompute_modules:
            documented.add("recompute_modules")
        require_sources(documented, self.sources)
        if ("selective" in self.recompute) != (self.selective is not None):
            raise ValueError("selective must be set exactly when recompute offers selective")
        if not self.elementwise_fused and self.eager_elementwise is None:
            raise ValueError("eager_elementwise is required when elementwise_fused is false")
        if bool(self.recompute_modules) != bool(self.recompute_modules_default) or not set(
                self.recompute_modules_default) <= set(self.recompute_modules):
            raise ValueError("recompute_modules_default must be a non-empty subset of recompute_modules, given with it")
        if self.recompute_modules and self.selective != "attention_core":
            raise ValueError("recompute_modules refine Megatron-style (attention_core) selective recomputation only")
        return self


__all__ += ["CompiledLoss", "EagerElementwise", "FineTuneRules", "StackFile"]


# --- Measured error bands (knowledge/bands.yaml, written by `python -m shardplan.validation.bands`) ---

BandQuantity = Literal["kv_capacity", "peak_memory", "tokens_per_second", "ttft_p50", "tpot_p50", "itl_p50",
                       "output_tokens_per_second", "layout_speed_ratio"]
BandKind = Literal["engine_log", "training", "finetune", "serving_load"]


class ErrorBand(Frozen):
    """How far the cost model's prediction of one quantity fell from the measurement, over the
    shipped cases of one engine generation or training stack (`shardplan validate`'s figures)."""

    kind: BandKind = Field(description="the corpus the cases come from")
    group: str = Field(min_length=1, description="the engine generation ('vLLM V1'), with a serving run's regime "
                                                 "('vLLM V1, saturated'), the stack ('torchtitan') or the stack and "
                                                 "fine-tuning method ('hf lora')")
    quantity: BandQuantity = Field(description="the predicted quantity: KV capacity (tokens), peak memory (bytes), "
                                               "tokens per second per GPU; under traffic the median TTFT and TPOT "
                                               "(seconds) and the output tokens per second")
    versions: tuple[str, ...] = Field(description="the engine versions of the cases, oldest first (empty for stacks)")
    num_cases: int = Field(ge=1, description="cases measured (count)")
    band_abs_error: float = Field(ge=0, description="the percentile of |predicted / measured - 1|, fraction "
                                                    "(0.05: within 5%)")
    mean_signed_error: float = Field(description="mean predicted / measured - 1, fraction: above 0 the model "
                                                 "predicts more than was measured")


class BandsFile(Frozen):
    """`knowledge/bands.yaml`: the band each predicted quantity carries, by engine generation or
    stack. Generated, not edited: a test checks it equals a fresh computation."""

    percentile: int = Field(ge=1, le=100, description="the band is this percentile of |error| (nearest rank)")
    generated_by: str = Field(min_length=1, description="the command that wrote the file")
    corpus: str = Field(min_length=1, description="what the cases are (the shipped corpus, each row with its source)")
    bands: tuple[ErrorBand, ...] = Field(description="one per (kind, group, quantity)")

    @model_validator(mode="after")
    def _unique(self) -> "BandsFile":
        keys = [(b.kind, b.group, b.quantity) for b in self.bands]
        if len(keys) != len(set(keys)):
            raise ValueError("a (kind, group, quantity) appears twice")
        return self

    def band(self, kind: str, group: str, quantity: str) -> ErrorBand | None:
        """The band of one group and quantity; None when no shipped case measured it."""
        return next((b for b in self.bands if (b.kind, b.group, b.quantity) == (kind, group, quantity)), None)


__all__ += ["BandKind", "BandQuantity", "BandsFile", "ErrorBand"]


# --- Prometheus series names by exporter and version (knowledge/metrics.yaml, read by `shardplan watch`) ---

MetricExporter = Literal["vllm", "sglang", "dcgm"]
MetricQuantity = Literal[
    "running_requests", "waiting_requests", "kv_usage_fraction", "kv_used_tokens", "kv_capacity_tokens",
    "cache_config", "ttft_seconds", "tpot_seconds", "request_tpot_seconds", "memory_used_mib", "memory_free_mib", "nvlink_bytes_total",
    "nvlink_tx_bytes_per_second", "pcie_tx_bytes_per_second"]
LabelRole = Literal["gpu_index", "gpu_uuid", "gpu_model", "host", "mig_instance", "pod", "engine_index"]


class MetricName(Frozen):
    """One series name an exporter emits for one quantity, from `since` (inclusive) to `until`
    (exclusive), in the exporter's own version numbering (the engine's, for vLLM and SGLang)."""

    exporter: MetricExporter = Field(description="who emits it")
    quantity: MetricQuantity = Field(description="what it measures, in shardplan's words")
    name: str = Field(min_length=1, max_length=200, description="the metric name as exposed (a histogram's base name)")
    kind: Literal["gauge", "counter", "histogram", "info"] = Field(description="its Prometheus type")
    unit: str = Field(min_length=1, description="the unit of its value (MiB, bytes, seconds, fraction, ...)")
    since: str | None = Field(description="first release that emits it by default; null: from the first one known")
    until: str | None = Field(description="first release that no longer emits it by default; null: still")
    range_established: bool = Field(True, description="false: the source gives a commit or PR, not a release "
                                                      "range; the range is then not used to prefer a name")
    source: str = Field(min_length=1, description="where the name comes from (file:line at a commit, PR, help text)")
    note: str = Field("", description="what else a reader needs to know")

    @model_validator(mode="after")
    def _check(self) -> "MetricName":
        for v in (self.since, self.until):
            if v is not None:
                parse_version(v)
        if self.since and self.until and parse_version(self.until) <= parse_version(self.since):
            raise ValueError(f"until {self.until} is not after since {self.since}")
        return self

    def emitted_at(self, version: tuple[int, int, int]) -> bool:
        """The release `version` emits it by default (a rule without an established range: unknown, False)."""
        if not self.range_established:
            return False
        lo = parse_version(self.since) if self.since else (0, 0, 0)
        return lo <= version and (self.until is None or version < parse_version(self.until))


class LabelRule(Frozen):
    """The labels that say which GPU, host, pod or engine a series belongs to."""

    exporter: MetricExporter
    role: LabelRole = Field(description="what the label identifies")
    names: tuple[str, ...] = Field(min_length=1, description="label names, any of which carries it")
    source: str = Field(min_length=1, description="where the label comes from")


class MetricsFile(Frozen):
    """`knowledge/metrics.yaml`: every series `shardplan watch` reads, with its source."""

    metrics: tuple[MetricName, ...] = Field(min_length=1)
    labels: tuple[LabelRule, ...] = Field(default=())

    @model_validator(mode="after")
    def _unique(self) -> "MetricsFile":
        keys = [(m.exporter, m.name) for m in self.metrics]
        if len(keys) != len(set(keys)):
            raise ValueError("a metric name appears twice for one exporter")
        roles = [(r.exporter, r.role) for r in self.labels]
        if len(roles) != len(set(roles)):
            raise ValueError("a label role appears twice for one exporter")
        return self

    def names(self, exporter: str, quantity: str, version: str | None = None) -> tuple[MetricName, ...]:
        """The names of `quantity`: those `version` emits by default first, and of those the ones not
        yet deprecated (no `until`) first; file order otherwise."""
        rules = [m for m in self.metrics if m.exporter == exporter and m.quantity == quantity]
        if version is None:
            return tuple(rules)
        v = parse_version(version)
        return tuple(sorted(rules, key=lambda m: (not m.emitted_at(v), m.until is not None)))

    def label_names(self, exporter: str, role: str) -> tuple[str, ...]:
        return next((r.names for r in self.labels if r.exporter == exporter and r.role == role), ())


__all__ += ["LabelRule", "MetricExporter", "MetricName", "MetricQuantity", "MetricsFile"]
