"""Command-line values -> cost-model inputs (Layout, workloads). Shared by every command that
takes the same flags, so they are declared and checked once; errors name the flag."""

from __future__ import annotations

import math
from typing import Any

from shardplan.cost.finetune import ALL_LINEAR, LORA_MODULES, BaseFormat, FineTune, check_targets
from shardplan.cost.layout import Layout, Offload, PipelineSchedule, Recompute
from shardplan.cost.workload import Framework, InferenceWorkload, Optimizer, Quantization, ServingLoad, TrainingWorkload
from shardplan.errors import LayoutError, ShardplanError
from shardplan.cost.engine import ONE_BATCH_NOTE, OVERLAP_NOTE, resolve_serving
from shardplan.cost import speculative as spec_decode
from shardplan.cost.speculative import Speculative, SpeculativeMethod
from shardplan.knowledge.schema import EngineRules, StackFile, parse_version
from shardplan.specs.cluster import at_most
from shardplan.specs.hardware import HardwareProfile
from shardplan.specs.model import CHECKPOINT_KINDS, MAX_TOKENS, ModelSpec, VisionSpec
from shardplan.units import DType, parse_dtype

MAX_SEQUENCES = 2**24  # sequences in a batch or in flight


GGML_KV_FORMATS = frozenset({"q8_0", "q4_0"})  # DType members that are ggml block formats (llama.cpp only)


def dtype_option(value: str | None, option: str) -> DType | None:
    if value is None or value == "auto":
        return None
    try:
        return parse_dtype(value)
    except KeyError:
        raise ShardplanError(
            f"unknown dtype {value!r}", field=option, hint="use one of bf16, fp16, fp32, fp8, int8, int4 (KV cache on llama.cpp: q8_0, q4_0)"
        ) from None


def layout_from_options(
    *,
    num_gpus: int,
    tp: int,
    pp: int,
    dp: int | None,
    cp: int,
    ep: int,
    etp: int | None,
    zero_stage: int,
    hybrid_shard: bool,
    sequence_parallel: bool,
    recompute: str,
    pp_schedule: str,
    virtual_stages: int,
    micro_batch_size: int,
    offload: str,
    pp_embedding_as_layer: bool = False,
    pp_loss_as_layer: bool = False,
    pp_first_stage_layers: int | None = None,
    pp_last_stage_layers: int | None = None,
) -> Layout:
    inner = tp * pp * cp
    if dp is None:
        if num_gpus % inner:
            raise LayoutError(
                f"tp x pp x cp = {inner} does not divide the {num_gpus} GPUs",
                field="--tp/--pp/--cp",
                hint="choose degrees whose product divides the GPU count",
            )
        dp = num_gpus // inner
    off_opt, off_par = offload_pair(offload)
    schedule = PipelineSchedule(pp_schedule)
    if virtual_stages > 1 and schedule is PipelineSchedule.ONE_F_ONE_B:
        schedule = PipelineSchedule.INTERLEAVED
    return Layout(
        tp=tp,
        pp=pp,
        dp=dp,
        cp=cp,
        ep=ep,
        etp=etp,
        zero_stage=zero_stage,
        hybrid_shard=hybrid_shard,
        sequence_parallel=sequence_parallel,
        recompute=Recompute(recompute),
        pp_schedule=schedule,
        virtual_stages=virtual_stages,
        micro_batch_size=micro_batch_size,
        offload_optimizer=off_opt,
        offload_params=off_par,
        pp_embedding_as_layer=pp_embedding_as_layer,
        pp_loss_as_layer=pp_loss_as_layer,
        pp_first_stage_layers=pp_first_stage_layers,
        pp_last_stage_layers=pp_last_stage_layers,
    )


OFFLOAD_CHOICES = ("none", "optimizer-cpu", "optimizer-nvme", "all-cpu", "all-nvme")


def offload_pair(value: str) -> tuple[Offload, Offload]:
    return {
        "none": (Offload.NONE, Offload.NONE),
        "optimizer-cpu": (Offload.CPU, Offload.NONE),
        "optimizer-nvme": (Offload.NVME, Offload.NONE),
        "all-cpu": (Offload.CPU, Offload.CPU),
        "all-nvme": (Offload.NVME, Offload.NVME),
    }[value]


# The last vLLM version whose rules shardplan applies to an encoder-decoder (cross-attention) model:
# vLLM 0.8 made V1 the default engine, which never ran encoder-decoder models (they fell back to V0:
# "one of the last use cases which V1 still doesn't support", vllm-project/vllm PR #23300,
# 2025-08-21), and PR #24907 (merged 2025-09-15) removed the V0 encoder-decoder runner and Mllama
# with it; shardplan's 0.8+ eras are V1's.
ENCODER_DECODER_LAST_VLLM = "0.7.3"


def _check_encoder_decoder(engine: EngineRules) -> None:
    if engine.engine == "vllm" and parse_version(engine.version) > parse_version(ENCODER_DECODER_LAST_VLLM):
        raise ShardplanError(
            f"vLLM {engine.version} has no V1 rules for a model that cross-attends to its vision encoder (Mllama): "
            "vLLM ran it on its V0 engine until PR #24907 removed it (2025-09)", field="--engine-version",
            hint=f"give --engine-version {ENCODER_DECODER_LAST_VLLM} (or older), whose V0 rules shardplan models")


def _batches_in_flight(engine: EngineRules, overlap_scheduling: bool | None, speculative: Speculative | None) -> int:
    """2 where the engine forms the next step's batch while a step runs (its version's default, or
    --overlap-scheduling), 1 where it does not or where the speculative method keeps it from it.
    Asking for either where the version has no switch (knowledge/engines/*.yaml overlap_switch), or
    for it where nothing turns it on, is refused."""
    era = engine.era
    switch = engine.overlap_switch
    if overlap_scheduling is not None and switch is None:
        how = OVERLAP_NOTE if era.batches_in_flight > 1 else ONE_BATCH_NOTE
        raise ShardplanError(f"{engine.label} has no switch for it: it {how}", field="--overlap-scheduling",
                             hint="leave it out, or pick an engine version that has one")
    if overlap_scheduling and switch is not None and switch.on_flag is None and era.batches_in_flight == 1:
        raise ShardplanError(f"{engine.label} has no flag that turns it on", field="--overlap-scheduling",
                             hint="leave it out")
    allowed = era.batches_in_flight_speculative
    if speculative is not None and allowed is not None and speculative.method.value not in allowed:
        if overlap_scheduling:
            raise ShardplanError(f"{engine.label} does not form batches ahead with {speculative.method.value} "
                                 f"speculative decoding ({era.sources['batches_in_flight_speculative']})",
                                 field="--overlap-scheduling", hint="leave it out")
        return 1
    if overlap_scheduling is None:
        return era.batches_in_flight
    return 2 if overlap_scheduling else 1


def inference_workload(
    *,
    max_model_len: int | None,
    max_num_seqs: int | None,
    max_num_batched_tokens: int | None,
    gpu_memory_utilization: float | None,
    block_size: int | None,
    kv_cache_dtype: str | None,
    weight_dtype: str | None,
    quantization: str | None,
    enforce_eager: bool,
    input_len: int,
    output_len: int,
    batch_size: int | None,
    engine: EngineRules | None = None,
    hw: HardwareProfile | None = None,
    model_max_len: int | None = None,
    enable_chunked_prefill: bool | None = None,
    speculative: Speculative | None = None,
    vision: VisionSpec | None = None,
    images_per_prompt: int | None = None,
    encoder_decoder: bool = False,
    checkpoint_format: str | None = None,
    mla: bool = False,
    sliding_window: bool = False,
    overlap_scheduling: bool | None = None,
) -> InferenceWorkload:
    """The serving workload from command-line values. With `engine` (and the `hw` and model
    context it runs), what is left out (None) takes that engine version's default for this
    device and context, and the budget switches follow its rules; without it, the fields take
    the dataclass defaults. `vision`: a multimodal model's tower, whose profiling pass the engine
    version's rules size (`images_per_prompt`: its limit_mm_per_prompt for images). `encoder_decoder`:
    the language model cross-attends to the encoder (Mllama), which vLLM ran only on its V0 engine
    (`_check_encoder_decoder`). `checkpoint_format`: the format the checkpoint ships in
    (ModelSpec.shipped_format: gpt-oss's MXFP4 experts, a block-quantized FP8 checkpoint's fp8); an
    engine that runs it as shipped (its knowledge's checkpoint_formats) plans it so unless another
    format is asked for. `mla`: the model's attention is MLA (SGLang's reserve for
    prefill CUDA graphs differs). `sliding_window`: some of its layers attend within a window (how
    the engine version caches them is stated with the answer). `overlap_scheduling`: the next step's
    batch is formed while a step runs (vLLM --async-scheduling, SGLang without
    --disable-overlap-schedule); None: the engine version's default."""
    if images_per_prompt is not None and not 1 <= images_per_prompt <= MAX_SEQUENCES:
        raise ShardplanError(f"must be from 1 to {MAX_SEQUENCES}", field="--limit-mm-per-prompt", hint="e.g. 1")
    if gpu_memory_utilization is not None and not 0 < gpu_memory_utilization <= 1:
        raise ShardplanError("must be in (0, 1]", field="--gpu-memory-utilization", hint="e.g. 0.9")
    for value, option in ((max_model_len, "--max-model-len"), (max_num_batched_tokens, "--max-num-batched-tokens"),
                          (input_len, "--input-len"), (output_len, "--output-len"), (block_size, "--block-size")):
        at_most(value, MAX_TOKENS, option)
    at_most(max_num_seqs, MAX_SEQUENCES, "--max-num-seqs")
    at_most(batch_size, MAX_SEQUENCES, "--batch-size")
    dense = DType.BF16
    quant = Quantization(quantization) if quantization else Quantization.NONE
    wd = dtype_option(weight_dtype, "--weight-dtype")
    if wd in (DType.BF16, DType.FP16, DType.FP32):
        dense = wd
    elif wd is not None:
        if quant is not Quantization.NONE and quant.value != wd.value:
            raise ShardplanError("conflicts with --quantization", field="--weight-dtype", hint="give one of them")
        try:
            quant = Quantization(wd.value)
        except ValueError:
            raise ShardplanError(f"no weight format for {wd.value}", field="--weight-dtype", hint="use fp8, int8 or int4") from None
    shipped = {c.format: c for c in engine.checkpoint_formats} if engine is not None else {}
    if quant.is_mxfp4:
        if checkpoint_format != "mxfp4":
            raise ShardplanError(f"{quant.value} is the format gpt-oss's routed experts ship in; this model's experts "
                                 "do not", field="--quantization", hint="use fp8, int8 or int4, or leave it out")
        if engine is not None and "mxfp4" not in shipped:
            raise ShardplanError(f"{engine.label} does not run MXFP4 experts", field="--quantization",
                                 hint="use --engine vllm or sglang, or another --quantization")
    # A format asked for that the engine's kernels do not run on this GPU at all (knowledge checkpoint_formats
    # refused_architectures; --allow-quantization offers neither awq nor gptq): refused, not planned.
    architecture = hw.gpu_architecture if hw is not None else None

    def refused_here(f: str) -> bool:
        return architecture is not None and f in shipped and architecture in shipped[f].refused_architectures

    if refused_here(quant.value):
        refused = shipped[quant.value]
        others = [f for f in ("fp8", "int8", "int4") if f != quant.value and not refused_here(f)]
        if quant.value in ("awq", "gptq"):
            others.append("the other of awq and gptq where it runs")
        raise ShardplanError(f"{engine.label} does not run {quant.value.upper()} on {architecture} GPUs "
                             f"({refused.refused_architectures_source})", field="--quantization",
                             hint=f"choose another format ({', '.join(others)}), or another engine")
    shipped_note = None
    fmt = shipped.get(checkpoint_format or "")
    if fmt is not None and fmt.needs_fp8_tensor_cores and (hw is None or DType.FP8 not in hw.peak_flops):
        fmt = None  # the model's own dtype on such GPUs (the format's needs_fp8_tensor_cores_source)
    # A quantized checkpoint's kind (ModelSpec.checkpoint_quantization): run as shipped only where the
    # engine's kernels for it run (knowledge checkpoint_formats `architectures`).
    kind = CHECKPOINT_KINDS.get(checkpoint_format or "")
    if kind is not None and quantization is None and wd is None and engine is not None and (fmt is None or not fmt.runs_on(architecture)):
        # A quantized checkpoint this engine version does not run here: planned at the model's dtype, and said.
        if fmt is None:
            why = f"shardplan's knowledge of {engine.label} (knowledge/engines) does not have it load the format as it ships"
            instead = "an engine that does (--engine vllm or sglang, on the GPUs they run it on) plans it as it ships"
        else:
            on = f"a {architecture} GPU" if architecture else "a GPU whose profile states no gpu.architecture"
            why = f"{engine.label} runs it on {', '.join(fmt.architectures or ())} GPUs, not on {on} ({fmt.architectures_source})"
            instead = ("a profile stating the GPU's gpu.architecture plans it as it ships where the engine runs it"
                       if architecture is None else f"on {', '.join(fmt.architectures or ())} GPUs it is planned as it ships")
        shipped_note = (f"the checkpoint ships {kind[1]} weights (its quantization_config) and {why}: "
                        f"planned at the model's dtype, which needs the model's 16-bit checkpoint; {instead}")
        fmt = None
    if quantization is None and wd is None and fmt is not None and engine is not None:
        quant = Quantization(kind[0] if kind is not None else fmt.format)
        if fmt.format == "fp8":
            shipped_note = (f"{engine.label}: the linear weights stay in FP8 as the block-quantized checkpoint ships them "
                          f"(its quantization_config; {fmt.source}); --weight-dtype bf16 plans a 16-bit copy")
        elif kind is not None:
            shipped_note = (f"{engine.label}: the linear weights stay {kind[1]} as the checkpoint ships them (its "
                            f"quantization_config; {fmt.source}); --weight-dtype bf16 plans a 16-bit copy")
        else:
            shipped_note = (f"{engine.label}: the routed experts stay in MXFP4 as the checkpoint ships them, 4.25 bits a "
                          f"weight (OCP MX: 32 FP4 values share an 8-bit scale; {fmt.source})")
        if fmt.without_fp4_tensor_cores is not None and hw is not None and DType.FP4 not in hw.peak_flops:
            quant = Quantization(fmt.without_fp4_tensor_cores)
            shipped_note += f"; without FP4 tensor cores they are held as {quant.value} ({fmt.without_fp4_tensor_cores_source})"
    base = InferenceWorkload()
    switches: dict = {}
    batched_given = max_num_batched_tokens is not None
    if engine is not None and encoder_decoder:
        _check_encoder_decoder(engine)
    if engine is not None:
        if hw is None or (max_model_len or model_max_len) is None:
            raise ValueError("engine rules need the hardware and the model's context")  # a caller's bug
        d = resolve_serving(engine, hw, max_model_len=max_model_len, model_max_len=model_max_len,
                            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                            gpu_memory_utilization=gpu_memory_utilization, block_size=block_size,
                            enable_chunked_prefill=enable_chunked_prefill, multimodal=vision is not None,
                            image_tokens=vision.image_tokens_max if vision else None,
                            image_encoder_tokens=vision.image_encoder_tokens_max if vision else None,
                            images_per_prompt=images_per_prompt, mla=mla, enforce_eager=enforce_eager,
                            speculative=speculative.method.value if speculative is not None else None)
        if d.max_model_len != (max_model_len or model_max_len):
            max_model_len = d.max_model_len  # the engine capped its default
        max_num_seqs, max_num_batched_tokens = d.max_num_seqs, d.max_num_batched_tokens
        if d.accounting == "dynamic" and not batched_given:
            # transformers' generate prefills the batch's prompts in one forward: that is its peak pass.
            max_num_batched_tokens = (batch_size or max_num_seqs) * input_len
        gpu_memory_utilization, block_size = d.gpu_memory_utilization, d.block_size
        switches = dict(engine=engine.engine, engine_version=engine.version, cuda_context_in_budget=d.cuda_context_in_budget,
                        cuda_graphs_in_budget=d.cuda_graphs_in_budget, refusal=d.refusal, accounting=d.accounting,
                        static_fraction_by_tp=d.static_fraction_by_tp,
                        static_fraction_by_tp_pipelined=d.static_fraction_by_tp_pipelined, python_ops_per_layer=d.python_ops_per_layer,
                        python_ops_per_layer_parts=d.python_ops_per_layer_parts,
                        python_ops_per_step=d.python_ops_per_step, cuda_graph_max_batch=d.cuda_graph_max_batch,
                        cuda_graph_max_batch_by_tp=d.cuda_graph_max_batch_by_tp,
                        step_overhead_seconds=d.step_overhead_seconds,
                        sampler_bytes_per_logit=d.sampler_bytes_per_logit, non_torch_bytes=d.non_torch_bytes,
                        warmup_free_share=d.warmup_free_share, warmup_total_factor=d.warmup_total_factor,
                        warmup_kv_tokens=d.warmup_kv_tokens, prefill_logit_bytes=d.prefill_logit_bytes,
                        prefill_logit_bytes_gathered=d.prefill_logit_bytes_gathered,
                        attention_workspace_bytes=d.attention_workspace_bytes,
                        assumptions=d.assumptions, vision_encoder_tokens=d.vision_encoder_tokens,
                        vision_kept_tokens=d.vision_kept_tokens)
        # The formats the search may fall back to, less those the engine does not run on this GPU at all.
        switches["weight_formats"] = tuple(f for f in engine.weight_formats if not refused_here(f))
        switches["kv_heads_copied"] = engine.kv_heads_copied
        switches["speculative_with_pp"] = engine.speculative_with_pp
        switches["fp8_marlin_architectures"] = engine.fp8_marlin_architectures
        era = engine.era
        switches.update(chunked_prefill=d.chunked_prefill, schedule=era.schedule,
                        graphs_for_prompt_steps=era.graphs_for_prompt_steps,
                        admission=None if era.admission is None else (
                            era.admission.initial_ratio, era.admission.min_ratio_factor, era.admission.decay_steps,
                            era.admission.clip_output_tokens),
                        admit_after_preemption=era.admit_after_preemption,
                        batches_in_flight=_batches_in_flight(engine, overlap_scheduling, speculative),
                        batches_in_flight_pp1_only=era.batches_in_flight_pp1_only,
                        hybrid_kv_cache=era.hybrid_kv_cache, kv_tokens_reported=era.kv_tokens_reported,
                        # vLLM's sliding-window groups hold max_concurrent_batches chunks: one without async scheduling
                        sliding_window_in_flight_batches=1 if overlap_scheduling is False
                        else era.sliding_window_in_flight_batches)
        note = _sliding_window_note(engine, max_num_batched_tokens) if sliding_window else None
        if note is not None:
            switches["assumptions"] = tuple(d.assumptions) + (note,)
        if switches["batches_in_flight"] != engine.era.batches_in_flight:
            # The version's default (its line among the engine notes) is not what this plan runs.
            why = "--overlap-scheduling" if overlap_scheduling else (
                "--no-overlap-scheduling" if overlap_scheduling is False
                else f"{speculative.method.value if speculative else ''} speculative decoding")
            how = OVERLAP_NOTE if switches["batches_in_flight"] > 1 else ONE_BATCH_NOTE
            kept = tuple(a for a in switches.get("assumptions", d.assumptions) if OVERLAP_NOTE not in a)
            switches["assumptions"] = kept + (f"{engine.label}: {how} ({why}), not its default",)
        if engine.offload is not None:
            o = engine.offload
            switches.update(offload_mode=o.mode, offload_gpu_layers=o.gpu_layers, offload_overlap=o.overlap,
                            offload_embedding_on_host=o.embedding_on_host, offload_kv_with_layer=o.kv_with_layer,
                            offload_batch_on_gpu_min_tokens=o.batch_on_gpu_min_tokens, offload_targets=tuple(o.targets),
                            offload_keeps_quantization=o.keeps_quantization, offload_stream_unit=o.stream_unit,
                            offload_pinned=o.pinned)
    kv_format = dtype_option(kv_cache_dtype, "--kv-cache-dtype")
    if kv_format is not None and kv_format.value in GGML_KV_FORMATS:
        if engine is None or kv_format.value not in engine.kv_block_formats:
            name = engine.display_name if engine is not None else "this engine"
            raise ShardplanError(f"{kv_format.value} is a ggml block format; {name} has no such KV cache",
                                 field="--kv-cache-dtype", hint="use --engine llamacpp, or fp8/bf16 for this engine")
        switches["assumptions"] = (*switches.get("assumptions", ()),
                                   f"KV cache {kv_format.value}: {engine.kv_block_formats_source}")
    if speculative is not None:
        switches["assumptions"] = (*switches.get("assumptions", ()), spec_decode.assumption(speculative))
    if shipped_note is not None:
        switches["assumptions"] = (*switches.get("assumptions", ()), shipped_note)
    return InferenceWorkload(
        max_model_len=max_model_len,
        max_num_seqs=base.max_num_seqs if max_num_seqs is None else max_num_seqs,
        max_num_batched_tokens=base.max_num_batched_tokens if max_num_batched_tokens is None else max_num_batched_tokens,
        gpu_memory_utilization=base.gpu_memory_utilization if gpu_memory_utilization is None else gpu_memory_utilization,
        block_size=base.block_size if block_size is None else block_size,
        **switches,
        kv_cache_dtype=kv_format,
        activation_dtype=dense,
        quantization=quant,
        enforce_eager=enforce_eager,
        input_len=input_len,
        output_len=output_len,
        batch_size=batch_size,
        speculative=speculative,
    )


# Tokens a drafter may propose per step: published setups propose 1-10 (vLLM's n-gram and draft-model
# examples), SGLang's EAGLE trees up to 64 draft tokens; each is also a KV slot held ahead per sequence.
MAX_SPECULATIVE_TOKENS = 128


def speculative_setup(spec: ModelSpec, *, method: str | None, num_speculative_tokens: int | None,
                      draft: ModelSpec | None, draft_source: str | None,
                      draft_hf_id: str | None = None) -> Speculative | None:
    """The speculative setup from --speculative-method, --num-speculative-tokens and
    --speculative-model, checked against the target `spec`; None when none is asked for.
    A draft model implies draft_model; mtp defaults K to the model's MTP layers (vLLM's n_predict)."""
    if method is None and draft is None:
        if num_speculative_tokens is not None:
            raise ShardplanError("given without a speculative method", field="--num-speculative-tokens",
                                 hint="add --speculative-model NAME or --speculative-method mtp|ngram")
        return None
    m = SpeculativeMethod(method) if method is not None else SpeculativeMethod.DRAFT_MODEL
    if m is SpeculativeMethod.DRAFT_MODEL and draft is None:
        raise ShardplanError("draft_model needs a draft", field="--speculative-method",
                             hint="add --speculative-model NAME|config.json")
    if m is not SpeculativeMethod.DRAFT_MODEL and draft is not None:
        raise ShardplanError(f"{m.value} uses no draft model", field="--speculative-model",
                             hint="drop --speculative-model, or use --speculative-method draft_model")
    if m is SpeculativeMethod.MTP and spec.num_mtp_layers < 1:
        raise ShardplanError(f"{spec.name} has no multi-token-prediction layers", field="--speculative-method",
                             hint="use --speculative-model NAME (a draft model) or --speculative-method ngram")
    if draft is not None and draft.vocab_size != spec.vocab_size:
        raise ShardplanError(f"the draft {draft.name} has a vocabulary of {draft.vocab_size} tokens, the target "
                             f"{spec.name} {spec.vocab_size}", field="--speculative-model",
                             hint="use a draft with the target's tokenizer (vLLM refuses a different vocab_size)")
    k = num_speculative_tokens
    if k is None:
        if m is not SpeculativeMethod.MTP:
            raise ShardplanError(f"{m.value} needs the number of tokens to propose", field="--num-speculative-tokens",
                                 hint="e.g. --num-speculative-tokens 4")
        k = spec.num_mtp_layers
    if k < 1:
        raise ShardplanError(f"{k} tokens: at least 1 must be proposed", field="--num-speculative-tokens",
                             hint="e.g. --num-speculative-tokens 4")
    at_most(k, MAX_SPECULATIVE_TOKENS, "--num-speculative-tokens")
    return Speculative(method=m, num_speculative_tokens=k, draft=draft, draft_source=draft_source, draft_hf_id=draft_hf_id)


def training_workload(
    *,
    seq_len: int,
    global_batch_size: int,
    optimizer: str,
    framework: str | None,
    flash_attention: bool | None,
    dropout: bool,
    overlap_grad_reduce: bool = True,
    stack: StackFile | None = None,
    compile: bool = False,
    attention_kernel: str | None = None,
    matmul_dtype: str | None = None,
    tp_comm_overlap: bool = False,
    compile_loss: bool | None = None,
    finetune: str = "full",
    lora_rank: int = 16,
    lora_alpha: float | None = None,
    lora_targets: str = ALL_LINEAR,
    lora_dropout: float = 0.0,
    qlora_double_quant: bool = True,
    paged_optimizer: bool = False,
    spec: ModelSpec | None = None,
    master_dtype: str | None = None,
    moment_dtype: str | None = None,
    optimizer_impl: str | None = None,
    reduce_bucket_size: str | None = None,
    recompute_modules: str | None = None,
    grad_reduce_dtype: str | None = None,
) -> TrainingWorkload:
    """The training workload from command-line values. With `stack`, what the stack fixes (its
    model-state bookkeeping, loss head, checkpointing, attention kernel, AMP, fusion) comes from
    its file; `framework` and `flash_attention` override it when given."""
    at_most(seq_len, MAX_TOKENS, "--seq-len")
    at_most(global_batch_size, MAX_SEQUENCES, "--global-batch-size")
    from_stack: dict = {}
    if stack is not None:
        from_stack = dict(
            stack=stack.stack, loss_bytes_per_logit=stack.loss_bytes_per_logit,
            loss_vocab_parallel=stack.loss_vocab_parallel,
            loss_parallel_bytes_per_logit=stack.loss_parallel_bytes_per_logit,
            largest_allocation_bytes_per_logit=stack.largest_allocation_bytes_per_logit,
            selective_policy=stack.selective or "attention_core", recompute_offered=tuple(stack.recompute),
            amp_fp32_master=stack.amp_fp32_master, norms_fp32=stack.norms_fp32,
            elementwise_fused=stack.elementwise_fused, attention_kernels=tuple(stack.attention_kernels),
            loss_forward_bytes_per_logit=stack.loss_forward_bytes_per_logit,
            loss_backward_bytes_per_logit=stack.loss_backward_bytes_per_logit,
            fsdp_unsharded_under_pp=stack.fsdp_unsharded_under_pp, pp_p2p_overlap=stack.pp_p2p_overlap,
            pp_holds_stage_outputs=stack.pp_holds_stage_outputs,
            collectives_multirail=stack.collectives_multirail, optimizer_foreach=stack.optimizer_foreach,
            eager_attention_bytes_per_score=stack.eager_attention_bytes_per_score,
            moe_expert_outputs_saved=stack.moe_expert_outputs_saved,
            fp8_saves_quantized_inputs=stack.fp8_saves_quantized_inputs,
            recompute_modules=tuple(stack.recompute_modules_default))
        if tp_comm_overlap and not stack.tp_comm_overlap_offered:
            raise ShardplanError(f"{stack.display_name} has no tensor-parallel communication overlap",
                                 field="--tp-comm-overlap", hint="drop it, or use --stack megatron")
        if stack.eager_elementwise is not None:
            from_stack.update(stack.eager_elementwise.model_dump())
        if compile:
            if not stack.compile_offered:
                raise ShardplanError(f"{stack.display_name} has no torch.compile path shardplan models", field="--compile",
                                     hint="drop --compile, or use --stack torchtitan or hf")
            # Inductor fuses each block's elementwise ops and saves the norm's 16-bit input only.
            from_stack.update(elementwise_fused=True, norms_fp32=False)
            cl = stack.compiled_loss
            if cl is not None and compile_loss is not False:  # None: the stack's current behaviour
                from_stack.update(loss_bytes_per_logit=cl.bytes_per_logit, loss_parallel_bytes_per_logit=None,
                                  largest_allocation_bytes_per_logit=cl.largest_allocation_bytes_per_logit,
                                  loss_forward_bytes_per_logit=cl.forward_bytes_per_logit,
                                  loss_backward_bytes_per_logit=cl.backward_bytes_per_logit)
    elif compile:
        from_stack.update(elementwise_fused=True)
    if attention_kernel is not None:
        if attention_kernel == "eager":
            flash_attention, from_stack["attention_kernels"] = False, ()
        else:
            from_stack["attention_kernels"] = (attention_kernel,)
    if framework is None:
        framework = stack.framework if stack is not None else Framework.ZERO.value
    if flash_attention is None:
        flash_attention = stack is None or stack.attention != "eager"
    if tp_comm_overlap:
        from_stack["tp_comm_overlap"] = True
    if matmul_dtype is not None:
        d = dtype_option(matmul_dtype, "--matmul-dtype") or DType.BF16
        if d not in (DType.BF16, DType.FP16, DType.FP8):
            raise ShardplanError(f"training GEMMs in {matmul_dtype} are not modelled", field="--matmul-dtype",
                                 hint="use bf16 or fp8")
        from_stack["matmul_dtype"] = d
    from_stack.update(_finetune_fields(finetune, lora_rank, lora_alpha, lora_targets, lora_dropout, qlora_double_quant,
                                       stack, spec, from_stack.get("matmul_dtype")))
    from_stack.update(_optimizer_dtypes(master_dtype, moment_dtype, stack, finetune, optimizer))
    if stack is not None and stack.hf_model_code:
        from shardplan.knowledge.model_support import hf_eager_softmax_fp32

        from_stack["eager_softmax_fp32"] = hf_eager_softmax_fp32(spec, from_stack.get("amp_fp32_master", False))
    if stack is not None:
        from_stack["zero_reduce_bucket_elements"] = stack.zero_reduce_bucket_elements
        from_stack["grads_allocated_in_backward"] = stack.grads_allocated_in_backward
        from_stack["ddp_gradient_buckets"] = stack.ddp_gradient_buckets
    if reduce_bucket_size is not None:
        from_stack["zero_reduce_bucket_elements"] = _reduce_bucket(reduce_bucket_size, stack, spec)
    if optimizer_impl is not None:
        if optimizer_impl not in ("foreach", "fused"):
            raise ShardplanError(f"{optimizer_impl!r} is not foreach or fused", field="--optimizer-impl",
                                 hint="use foreach or fused")
        from_stack["optimizer_foreach"] = optimizer_impl == "foreach"
    if recompute_modules is not None:
        from_stack["recompute_modules"] = _recompute_modules(recompute_modules, stack, spec)
    if grad_reduce_dtype is not None:
        from_stack["grad_reduce_dtype"] = _grad_reduce_dtype(grad_reduce_dtype, stack, finetune)
    return TrainingWorkload(
        seq_len=seq_len,
        global_batch_size=global_batch_size,
        optimizer=Optimizer(optimizer),
        paged_optimizer=paged_optimizer,
        framework=Framework(framework),
        flash_attention=flash_attention,
        dropout=dropout,
        overlap_grad_reduce=overlap_grad_reduce,
        **from_stack,
    )


MAX_REDUCE_BUCKET_ELEMENTS = 10**11


def _grad_reduce_dtype(value: str, stack: StackFile | None, finetune: str) -> DType:
    """--grad-reduce-dtype: the dtype of the main gradients where the stack keeps them in a buffer of
    their own and offers a choice (Megatron-Core: fp32 under bf16 by default, bf16 with
    --grad-reduce-in-bf16; knowledge/stacks/megatron.yaml)."""
    if value not in ("fp32", "bf16"):
        raise ShardplanError(f"--grad-reduce-dtype {value!r} is not fp32 or bf16", field="--grad-reduce-dtype",
                             hint="use fp32 (Megatron's default under --bf16) or bf16 (--grad-reduce-in-bf16)")
    offered = stack.optimizer_dtypes.grads if stack is not None else ["fp32"]
    if value not in offered:
        name = stack.display_name if stack is not None else "this stack"
        raise ShardplanError(f"{name} offers no {value} main gradients (--grad-reduce-dtype sets Megatron-Core's "
                             f"grad_reduce_in_fp32; {name}: {', '.join(offered)})",
                             field="--grad-reduce-dtype", hint="drop it, or use --stack megatron")
    if value != "fp32" and finetune != "full":
        raise ShardplanError(f"--grad-reduce-dtype {value} applies to full training (the adapters' gradients stay fp32)",
                             field="--grad-reduce-dtype", hint="drop it, or use --finetune full")
    return DType(value)


def _recompute_modules(value: str, stack: StackFile | None, spec: ModelSpec | None) -> tuple[str, ...]:
    """--recompute-modules: the submodules selective recomputation recomputes, as the stack names
    them (Megatron-Core's --recompute-modules), checked against the model as Megatron's
    TransformerConfig checks them (mla_up_proj needs MLA; moe_act, moe and shared_experts an MoE)."""
    if stack is None or not stack.recompute_modules:
        raise ShardplanError("--recompute-modules names Megatron-Core's fine-grained recomputation",
                             field="--recompute-modules", hint="drop it, or use --stack megatron")
    names = [n.strip() for n in value.split(",") if n.strip()]
    if not names or len(names) > len(stack.recompute_modules):
        raise ShardplanError(f"--recompute-modules {value[:80]!r} names no module, or too many",
                             field="--recompute-modules", hint=f"a comma-separated subset of {', '.join(stack.recompute_modules)}")
    for n in names:
        if n not in stack.recompute_modules:
            raise ShardplanError(f"{n[:40]!r} is not one of {stack.display_name}'s recompute modules",
                                 field="--recompute-modules", hint=f"use {', '.join(stack.recompute_modules)}")
    if spec is not None:
        needs = {"mla_up_proj": (spec.mla is not None, "multi-head latent attention"),
                 "moe_act": (spec.moe is not None, "MoE layers"), "moe": (spec.moe is not None, "MoE layers"),
                 "shared_experts": (spec.moe is not None and spec.moe.num_shared_experts > 0, "shared experts")}
        for n in names:
            present, what = needs.get(n, (True, ""))
            if not present:
                raise ShardplanError(f"--recompute-modules {n} needs {what}, which {spec.name} does not have",
                                     field="--recompute-modules", hint=f"drop {n}")
    return tuple(dict.fromkeys(names))


def _reduce_bucket(value: str, stack: StackFile | None, spec: ModelSpec | None) -> int:
    """--reduce-bucket-size: DeepSpeed's zero_optimization.reduce_bucket_size in elements, or auto
    (hidden_size x hidden_size, as the Hugging Face Trainer fills it in)."""
    if stack is None or not stack.zero_reduce_bucket_elements:
        raise ShardplanError("--reduce-bucket-size is DeepSpeed's ZeRO bucket", field="--reduce-bucket-size",
                             hint="drop it, or use --stack deepspeed")
    if value.strip().lower() == "auto":
        if spec is None:
            raise ShardplanError("--reduce-bucket-size auto needs the model's hidden size", field="--reduce-bucket-size",
                                 hint="give a number of elements, e.g. 5e8")
        return spec.hidden_size * spec.hidden_size
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not (math.isfinite(number) and number >= 1 and number == int(number) and number <= MAX_REDUCE_BUCKET_ELEMENTS):
        raise ShardplanError(f"--reduce-bucket-size {value!r} is not a whole number of elements from 1 to 1e11, or auto",
                             field="--reduce-bucket-size", hint="e.g. 5e8 (DeepSpeed's default), 2e8, or auto")
    return int(number)


def _optimizer_dtypes(master: str | None, moments: str | None, stack: StackFile | None, finetune: str,
                      optimizer: str) -> dict:
    """The optimizer's master and moment dtypes, checked against what the stack's optimizer keeps."""
    out: dict = {}
    for value, field, offered_by in ((master, "master_dtype", "master"), (moments, "moment_dtype", "moments")):
        if value is None or value == "fp32":
            continue
        flag = "--" + field.replace("_", "-")
        offered = getattr(stack.optimizer_dtypes, offered_by) if stack is not None else ["fp32", "bf16"]
        if value not in offered:
            raise ShardplanError(f"{stack.display_name if stack else 'this stack'}'s optimizer keeps its {offered_by} in "
                                 f"{', '.join(offered)} only", field=flag,
                                 hint="drop it, or use --stack deepspeed (bf16 master weights and moments) or --stack "
                                      "megatron (bf16 moments)")
        if finetune != "full":
            raise ShardplanError(f"{flag} {value} applies to full fine-tuning (the adapters' states stay fp32)",
                                 field=flag, hint="drop it, or use --finetune full")
        if field == "moment_dtype" and optimizer == "adamw8bit":
            raise ShardplanError("8-bit AdamW keeps its own 8-bit moments", field=flag,
                                 hint="drop --moment-dtype, or use --optimizer adamw")
        out[field] = DType(value)
    if stack is not None and stack.optimizer_dtypes.paired and (master or "fp32") != (moments or "fp32"):
        raise ShardplanError(f"{stack.display_name}'s optimizer (torch.optim) keeps its moments in the dtype of the "
                             f"weights it steps (asked: master {master or 'fp32'}, moments {moments or 'fp32'})",
                             field="--moment-dtype", hint="pass --master-dtype and --moment-dtype with the same dtype")
    if "master_dtype" in out and stack is not None and stack.amp_fp32_master:
        # bf16 master weights under AMP over fp32 weights: the model is loaded in bf16 and trained
        # without autocast (pure bf16), the optimizer stepping the bf16 weights themselves
        out["amp_fp32_master"] = False
    return out


def _finetune_fields(
    method: str, rank: int, alpha: float | None, targets: str, dropout: float, double_quant: bool,
    stack: StackFile | None, spec: ModelSpec | None, matmul_dtype: DType | None,
) -> dict:
    """TrainingWorkload's fine-tuning fields from the options, checked against the stack and the model."""
    ft = FineTune(method)
    if stack is not None and ft.value not in stack.finetune.offered:
        raise ShardplanError(f"{stack.display_name} does not run {ft.value} fine-tuning (it offers "
                             f"{', '.join(stack.finetune.offered)})", field="--finetune",
                             hint="use --stack hf (PEFT and bitsandbytes), or another --finetune")
    if ft is FineTune.FULL:
        return {}
    if not 1 <= rank <= 65536:
        raise ShardplanError(f"LoRA rank {rank} is outside 1-65536", field="--lora-rank", hint="use e.g. 8, 16 or 64")
    if not 0.0 <= dropout < 1.0:
        raise ShardplanError(f"lora dropout {dropout} is outside [0, 1)", field="--lora-dropout", hint="use e.g. 0.05")
    names = tuple(dict.fromkeys(t.strip() for t in targets.split(",") if t.strip()))
    if not names or len(names) > 64:
        raise ShardplanError("no LoRA target modules given" if not names else "more than 64 LoRA target modules",
                             field="--lora-targets", hint=f"name modules such as q_proj,v_proj, or {ALL_LINEAR}")
    if spec is not None:
        if spec.mla is not None and names != (ALL_LINEAR,):
            raise ShardplanError("LoRA targets by module name are not modelled for multi-head latent attention",
                                 field="--lora-targets", hint=f"use --lora-targets {ALL_LINEAR}")
        unknown = check_targets(spec, names)
        if unknown:
            raise ShardplanError(f"{spec.name} has no linear module named {', '.join(unknown)}", field="--lora-targets",
                                 hint=f"use {', '.join(LORA_MODULES)} or {ALL_LINEAR}")
    if ft is FineTune.QLORA and matmul_dtype is DType.FP8:
        raise ShardplanError("a 4-bit QLoRA base dequantizes to 16 bits for its GEMMs, not fp8", field="--matmul-dtype",
                             hint="drop --matmul-dtype fp8")
    out: dict = dict(finetune=ft, lora_rank=rank, lora_alpha=float(alpha) if alpha is not None else 2.0 * rank,
                     lora_targets=names, lora_dropout=dropout)
    if ft is FineTune.QLORA:
        out.update(base_format=BaseFormat.NF4_DQ if double_quant else BaseFormat.NF4,
                   base_fp32_non_quantized=stack.finetune.qlora_fp32_non_quantized if stack is not None else False)
    return out


MAX_LOAD_REQUESTS = 100_000  # requests one simulation runs: its work grows with them


# The lowest request rate simulated: 1,000 arrivals a million seconds apart span 1e9 s, where float64
# still resolves 1e-7 s, well under any step; at 1e-12 requests/s the latencies come out quantised.
MIN_REQUEST_RATE = 1e-6


def serving_load(*, request_rate: str | None, concurrency: int | None, num_prompts: int, lengths: Any,
                 lengths_name: str, prefix_cache_hit: float, arrivals: str, seed: int, input_len: int, output_len: int,
                 max_model_len: int | None, spec_acceptance_rate: float | None = None,
                 speculative: bool = False, context_option: str = "--max-model-len") -> ServingLoad | None:
    """The traffic of --request-rate / --concurrency (None when neither is given). `lengths`: a
    LengthDistribution from --dataset-lengths (specs/lengths.py), or None for the fixed
    --input-len/--output-len; requests longer than `max_model_len` are dropped, as the engine
    refuses them, and an error says so when none fits."""
    if spec_acceptance_rate is not None:
        if not speculative:
            raise ShardplanError("applies to speculative decoding", field="--spec-acceptance-rate",
                                 hint="add --speculative-model NAME or --speculative-method mtp|ngram")
        if not (math.isfinite(spec_acceptance_rate) and 0 < spec_acceptance_rate <= 1):
            raise ShardplanError(f"must be in (0, 1] (got {spec_acceptance_rate})", field="--spec-acceptance-rate",
                                 hint="the chance each drafted token is accepted, e.g. 0.7")
    if request_rate is None and concurrency is None:
        for value, default, option in ((lengths_name, "fixed", "--dataset-lengths"), (prefix_cache_hit, 0.0, "--prefix-cache-hit"),
                                       (spec_acceptance_rate, None, "--spec-acceptance-rate")):
            if value != default:
                raise ShardplanError("applies to traffic", field=option,
                                     hint="add --request-rate R or --concurrency C (or leave the option out)")
        return None
    rate = math.inf
    if request_rate is not None:
        try:
            rate = float(request_rate)
        except ValueError:
            raise ShardplanError(f"'{request_rate}' is not a number", field="--request-rate",
                                 hint="requests per second, e.g. 4 or 0.5, or inf for all at once") from None
        if math.isnan(rate) or rate <= 0:
            raise ShardplanError(f"must be a number > 0 (got {request_rate})", field="--request-rate",
                                 hint="requests per second, e.g. 4, or inf for all at once")
        if rate < MIN_REQUEST_RATE:  # arrivals that far apart swallow the step times in float64
            raise ShardplanError(f"must be at least {MIN_REQUEST_RATE:g} requests/s (got {request_rate}): the "
                                 "simulation's clock cannot resolve a step beside arrivals that far apart",
                                 field="--request-rate", hint="at so low a rate each request runs alone: e.g. --request-rate 0.01")
    if concurrency is not None and not 1 <= concurrency <= MAX_SEQUENCES:
        raise ShardplanError(f"must be from 1 to {MAX_SEQUENCES}", field="--concurrency", hint="e.g. 64")
    if not 1 <= num_prompts <= MAX_LOAD_REQUESTS:
        raise ShardplanError(f"must be from 1 to {MAX_LOAD_REQUESTS:,}", field="--num-prompts", hint="e.g. 1000")
    if not (math.isfinite(prefix_cache_hit) and 0 <= prefix_cache_hit < 1):
        raise ShardplanError(f"must be in [0, 1) (got {prefix_cache_hit})", field="--prefix-cache-hit",
                             hint="the share of each prompt found in the prefix cache, e.g. 0.3")
    if arrivals not in ("poisson", "constant"):
        raise ShardplanError(f"unknown arrivals '{arrivals}'", field="--arrivals", hint="poisson or constant")
    if lengths is None:
        check_request_fits(input_len, output_len, max_model_len, context_option)
    if lengths is not None and max_model_len is not None:
        lengths = lengths.clipped(max_model_len)
    return ServingLoad(request_rate_per_second=rate, max_concurrency=concurrency, num_requests=num_prompts,
                       lengths=lengths, lengths_name=lengths_name, prefix_cache_hit_fraction=prefix_cache_hit,
                       poisson=arrivals == "poisson", seed=seed, spec_acceptance_rate=spec_acceptance_rate)


DEFAULT_INPUT_LEN_TOKENS = 1024  # the request serving commands size for when --input-len is left out
DEFAULT_OUTPUT_LEN_TOKENS = 128


def request_lengths(input_len: int | None, output_len: int | None, context: int | None) -> tuple[int, int, str | None]:
    """(prompt, output) tokens of a request: as given; where left out, the default request
    (DEFAULT_INPUT_LEN_TOKENS + DEFAULT_OUTPUT_LEN_TOKENS), shortened to the model's context when
    that is shorter (an eighth of it for the output, the rest for the prompt, less what a given
    length takes), with the note that says so. A given length that leaves no room is refused
    later, by `check_request_fits`, under its own option."""
    inp = DEFAULT_INPUT_LEN_TOKENS if input_len is None else input_len
    out = DEFAULT_OUTPUT_LEN_TOKENS if output_len is None else output_len
    if context is None or inp + out <= context or (input_len is not None and output_len is not None):
        return inp, out, None
    if input_len is None and output_len is None:
        out = max(1, min(out, context // 8))
        inp = max(1, context - out)
    elif input_len is None:
        inp = context - out if context - out >= 1 else inp
    else:
        out = context - inp if context - inp >= 1 else out
    if inp + out > context:
        return inp, out, None
    return inp, out, (f"requests of {inp:,} prompt and {out:,} output tokens: the default request "
                      f"({DEFAULT_INPUT_LEN_TOKENS:,} + {DEFAULT_OUTPUT_LEN_TOKENS:,} tokens) exceeds the {context:,}-token "
                      "context, so what --input-len/--output-len left out was shortened to fit")


def check_request_fits(input_len: int, output_len: int, max_model_len: int | None,
                       context_option: str = "--max-model-len") -> None:
    """A request of `input_len` prompt and `output_len` output tokens must fit the context the engine
    admits (`max_model_len`, the model's own when not set): the engine refuses a longer one."""
    if max_model_len is not None and input_len + output_len > max_model_len:
        if max_model_len < 2:  # a request is at least one prompt and one output token
            raise ShardplanError(f"a context of {max_model_len} token holds no request (one prompt and one output "
                                 "token at least)", field=context_option, hint=f"raise {context_option} to 2 or more")
        out = max(1, min(output_len, max_model_len // 8))
        raise ShardplanError(f"--input-len {input_len} + --output-len {output_len} exceed the context "
                             f"({max_model_len:,} tokens)", field="--input-len",
                             hint=f"give requests that fit, e.g. --input-len {max(1, max_model_len - out)} --output-len "
                                  f"{out}, or raise {context_option} if the model's context allows")


def _sliding_window_note(engine: EngineRules, batched_tokens: int) -> str | None:
    """How this engine version caches a model's sliding-window layers, as the answer states it
    (vLLM, whose rule is read by version; None for the engines whose rule is not modelled)."""
    era = engine.era
    if era.hybrid_kv_cache and era.accounting == "fixed_context":  # llama.cpp's iSWA cache
        return (f"{engine.label}: the sliding-window layers get a cache of their own, the window x the sequences + "
                f"one ubatch ({batched_tokens:,}) cells padded to 256, the full-attention ones the whole context "
                f"({era.sources['hybrid_kv_cache']})")
    if era.hybrid_kv_cache:
        chunks = era.sliding_window_in_flight_batches
        held = f"{chunks} x {batched_tokens:,}" if chunks > 1 else f"{batched_tokens:,}"
        return (f"{engine.label}: sliding-window and full-attention layers form KV cache groups of equal size drawing "
                f"on one pool (the hybrid KV cache manager); a request holds its window and up to {held} scheduled "
                f"tokens in each sliding group, its whole sequence in each full one ({era.sources['hybrid_kv_cache']})")
    if engine.engine != "vllm":
        return None
    return (f"{engine.label}: every attention layer, sliding-window ones included, holds a request's whole sequence "
            "in the KV cache (vLLM's hybrid KV cache manager came with 0.9.1)")

