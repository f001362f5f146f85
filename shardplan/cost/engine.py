"""An engine's rules (knowledge/engines/*.yaml, resolved to `EngineRules`) applied to one
deployment: the serving defaults and budget switches the cost model reads, each with the
sentence that says which rule set it and why.

The profiling pass: vLLM sizes the KV cache after one forward of max_num_batched_tokens
tokens (V0 `Worker.determine_num_available_blocks`, V1 `gpu_worker.determine_available_memory`
-> `profile_run`). Its default follows the scheduler's rules: without chunked prefill
max(max_model_len, 2048) tokens; with it, the chunked budget (by version and device). V0
turned chunked prefill on by itself only above a 32K context, so V0's verdict is not
monotonic in max_model_len: a longer context can profile a smaller pass and fit.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardplan.knowledge.schema import EngineRules, MultimodalEra
from shardplan.specs.hardware import HardwareProfile
from shardplan.units import BYTES_PER_GIB, BYTES_PER_MIB, us_to_seconds


@dataclass(frozen=True)
class ServingDefaults:
    """The engine's effective settings for one deployment and why each has its value."""

    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    chunked_prefill: bool
    gpu_memory_utilization: float
    block_size: int
    cuda_context_in_budget: bool
    cuda_graphs_in_budget: bool
    refusal: str
    accounting: str
    static_fraction_by_tp: tuple[tuple[int, float], ...]
    python_ops_per_layer: float
    python_ops_per_layer_parts: tuple[tuple[str, float], ...]
    python_ops_per_step: float
    cuda_graph_max_batch: int
    step_overhead_seconds: float
    sampler_bytes_per_logit: float
    non_torch_bytes: float | None
    warmup_free_share: float
    warmup_total_factor: float
    warmup_kv_tokens: int
    prefill_logit_bytes: float
    prefill_logit_bytes_gathered: float
    attention_workspace_bytes: float
    assumptions: tuple[str, ...]
    # The profiling pass of a multimodal model's vision tower (profile_vision below): the tokens it
    # runs through the tower, and the encoder output rows still alive while the text pass profiles.
    vision_encoder_tokens: int = 0
    vision_kept_tokens: int = 0
    # SGLang >= 0.5.10 with pp > 1: the by-tp fractions without the prefill CUDA graphs' reserve
    # (pp > 1 turns them off); empty: the same as static_fraction_by_tp.
    static_fraction_by_tp_pipelined: tuple[tuple[int, float], ...] = ()
    # (from tp, CUDA-graph batch) where the engine's default grows with the tensor-parallel size
    # (SGLang from 0.5.3: 512 at tp >= 4 on 60-160 GiB GPUs); empty: cuda_graph_max_batch at any tp.
    cuda_graph_max_batch_by_tp: tuple[tuple[int, int], ...] = ()


def profile_vision(mm: MultimodalEra, *, image_tokens: int, image_encoder_tokens: int, max_num_seqs: int,
                   max_num_batched_tokens: int, max_model_len: int,
                   images_per_prompt: int | None) -> tuple[int, int, str]:
    """(tokens through the vision tower, encoder output rows kept during the text pass, why) in the
    profiling pass of one engine version; images only (a video item is not modelled).

    sequences (vLLM V0 worker/model_runner.py profile_run): max(1, min(S, B // (L x T))) dummy
    sequences of B / S' tokens, each carrying L images of the largest size, run through the model
    in one forward: the tower sees all of them, and its outputs become the sequences' embeddings (no
    extra rows). From 0.7 the processor-based profiler gives a sequence too short for its images'
    tokens no images at all (multimodal/profiling.py, "V0 does not support chunked prefill").
    encoder_budget (V1 gpu_model_runner.py profile_run, encoder_cache_manager.py): a budget of
    max(B, T) tokens; items = budget / T (ceil to 0.9, floor from 0.10), at most S x L (from 0.10
    S x max(1, min(L, max_model_len // T))); the tower runs once on all of them and its outputs stay
    in the encoder cache while the text pass runs (0.11.0 pads each to the whole budget)."""
    limit = images_per_prompt or mm.items_per_prompt
    t, b, s = image_tokens, max_num_batched_tokens, max_num_seqs
    if mm.profile == "sequences":
        seqs = max(1, min(s, b // (limit * t)))
        if mm.text_only_when_longer and limit * t > b // seqs:
            return 0, 0, (f"the profiling pass's {seqs} dummy sequence(s) of {b // seqs:,} tokens are too short for "
                          f"{limit} image(s) of {t:,} tokens: text only ({mm.sources['text_only_when_longer']})")
        items = seqs * limit
        return items * image_encoder_tokens, 0, (
            f"the profiling pass runs {items} image(s) of the largest size ({t:,} tokens, {image_encoder_tokens:,} "
            f"through the tower) in {seqs} dummy sequence(s) ({mm.sources['profile']})")
    budget = max(b, t)
    if mm.items_rounding == "ceil":
        by_budget = -(-budget // t)
    else:
        by_budget = budget // t
    per_prompt = max(1, min(limit, max_model_len // t)) if mm.items_capped_by_context else limit
    items = max(1, min(by_budget, s * per_prompt))
    kept = 0
    if mm.outputs_kept:
        kept = items * (budget if mm.outputs_padded_to_budget else t)
    return items * image_encoder_tokens, kept, (
        f"encoder budget of {budget:,} tokens profiled with {items} image(s) of the largest size ({t:,} tokens, "
        f"{image_encoder_tokens:,} through the tower); {kept:,} rows of its outputs stay alive during the text pass "
        f"({mm.sources['profile']})")


def chunked_prefill_on(rules: EngineRules, max_model_len: int, asked: bool | None, multimodal: bool) -> tuple[bool, str]:
    era = rules.era
    if era.chunked_prefill == "always":
        return True, f"{rules.label}: chunked prefill is always on ({era.sources['chunked_prefill']})"
    if asked is not None:
        return asked, f"{rules.label}: chunked prefill {'on' if asked else 'off'}, as asked"
    if era.chunked_prefill == "above_context" and not multimodal:
        above = era.chunked_prefill_above_tokens
        assert above is not None  # the schema requires it for above_context
        on = max_model_len > above
        return on, (f"{rules.label}: chunked prefill {'on' if on else 'off'} by default because max_model_len "
                    f"{max_model_len:,} is {'above' if on else 'at most'} {above:,} ({era.sources['chunked_prefill']})")
    return False, f"{rules.label}: chunked prefill off by default ({era.sources['chunked_prefill']})"


def prefill_graphs_reserve(rules: EngineRules, prefill_tokens: int, context_tokens: int | None, *, mla: bool,
                           multimodal: bool, speculative: str | None, enforce_eager: bool) -> tuple[float, bool, str]:
    """(MiB the prefill CUDA graphs add to SGLang's reserve, whether pp > 1 turns them off, why).

    SGLang >= 0.5.10 captures prefill graphs by default unless something turns them off: non-MLA,
    per_capture_size_mib x len(capture sizes up to the chunked-prefill budget, at most the context
    asked for where clamped_to_context); MLA, a flat mla_mib (server_args.py _handle_gpu_memory_settings
    at 0.5.10 lines 1254-1312; arg_groups/memory_hook.py reserve_for_graph_mb at 0.5.23)."""
    reserve = rules.era.static_fraction_reserved
    pg = reserve.prefill_graphs if reserve is not None else None
    if pg is None:
        return 0.0, False, ""
    source = rules.era.sources["static_fraction_reserved"]
    inputs = {"multimodal": multimodal, "speculative": speculative is not None, "mla": mla, "eager": enforce_eager}
    off = [k for k in pg.off_for if inputs.get(k)]
    off_for_pp = "pipeline_parallel" in pg.off_for
    if off:
        return 0.0, off_for_pp, (f"{rules.label}: no prefill CUDA graphs ({', '.join(off)} turns them off), none in "
                                 f"the reserve ({source})")
    max_tokens = prefill_tokens
    if pg.clamped_to_context and context_tokens is not None:
        max_tokens = min(max_tokens, context_tokens)
    mib = pg.reserve_mib(max_tokens=max_tokens, mla=mla)
    if mla:
        what = f"{mib:g} MiB for an MLA model"
    else:
        what = (f"{len(pg.sizes_tokens(max_tokens))} capture sizes up to {max_tokens:,} tokens x "
                f"{pg.per_capture_size_mib:g} MiB = {mib:g} MiB")
    pp = " (none with pp > 1)" if off_for_pp else ""
    return mib, off_for_pp, f"{rules.label}: prefill CUDA graphs on by default{pp}: {what} in the reserve ({source})"


# How the engine notes name its default of forming the next batch while a step runs (a plan that
# overrides it replaces the line: cost/inputs.py).
OVERLAP_NOTE = "forms the next step's batch while a step runs"
ONE_BATCH_NOTE = "forms each step's batch when the step before ends"
# TGI reads the free memory with torch.cuda.mem_get_info, which counts the caching allocator's reserved
# segments whether in use or not (memory_serving.warmup_reserved_bytes).
WARMUP_CACHE_NOTE = ("the free memory is read with torch.cuda.mem_get_info, so the segments PyTorch's caching "
                     "allocator keeps from the warm-up's layer temporaries count beside the logits (which are too "
                     "large to reuse them), unless the two do not fit, when the allocator frees its cache and "
                     "retries (c10/cuda/CUDACachingAllocator.cpp DeviceCachingAllocator::malloc)")


def resolve_serving(rules: EngineRules, hw: HardwareProfile, *, max_model_len: int | None,
                    model_max_len: int | None = None, multimodal: bool = False, max_num_seqs: int | None = None,
                    max_num_batched_tokens: int | None = None, gpu_memory_utilization: float | None = None,
                    block_size: int | None = None, enable_chunked_prefill: bool | None = None,
                    image_tokens: int | None = None, image_encoder_tokens: int | None = None,
                    images_per_prompt: int | None = None, mla: bool = False, speculative: str | None = None,
                    enforce_eager: bool = False) -> ServingDefaults:
    """Fill what the user left out with the engine's defaults for this device and context.
    `max_model_len` None takes the model's context (`model_max_len`), capped where the engine caps
    its default. `mla`, `speculative` (the method: draft_model, mtp, ngram) and `enforce_eager`
    shape SGLang's default reserve (static_fraction_reserved)."""
    era = rules.era
    context_given = max_model_len is not None
    seqs_given = max_num_seqs is not None
    memory_gib = hw.memory_capacity_bytes / BYTES_PER_GIB
    device = hw.gpu_model
    notes: list[str] = []
    if max_model_len is None:
        if model_max_len is None:
            raise ValueError("max_model_len or the model's context is needed")  # a caller's bug
        max_model_len = model_max_len
        if era.max_model_len_cap is not None and model_max_len > era.max_model_len_cap:
            max_model_len = era.max_model_len_cap
            notes.append(f"{rules.label}: max_model_len {max_model_len:,} by default, the model's {model_max_len:,} "
                         f"capped ({era.sources['max_model_len_cap']})")
    if max_num_seqs is None:
        max_num_seqs = rules.by_device(era.max_num_seqs, memory_gib, device)
        notes.append(f"{rules.label}: max_num_seqs {max_num_seqs} by default on {device} ({era.sources['max_num_seqs']})")
    multimodal = multimodal or image_tokens is not None
    mm = rules.multimodal if multimodal else None
    chunked, why = chunked_prefill_on(rules, max_model_len, enable_chunked_prefill, multimodal)
    notes.append(why)
    batched_given = max_num_batched_tokens is not None
    if max_num_batched_tokens is None:
        if chunked:
            max_num_batched_tokens = rules.by_device(era.chunked_budget_tokens, memory_gib, device)
            notes.append(f"{rules.label}: profile pass of {max_num_batched_tokens:,} tokens, the chunked-prefill "
                         f"budget on {device} ({era.sources['chunked_budget_tokens']})")
        else:
            extra = era.unchunked_extra_tokens
            max_num_batched_tokens = max(max_model_len + extra, era.unchunked_min_tokens)
            plus = f" + {extra}" if extra else ""
            notes.append(f"{rules.label}: profile pass of {max_num_batched_tokens:,} tokens = max(max_model_len{plus}, "
                         f"{era.unchunked_min_tokens:,}) without chunked prefill ({era.sources['unchunked_min_tokens']})")
    if mm is not None and not batched_given and not chunked and max_num_batched_tokens < mm.min_batched_tokens:
        max_num_batched_tokens = mm.min_batched_tokens
        notes.append(f"{rules.label}: a multimodal model profiles at least {max_num_batched_tokens:,} tokens "
                     f"({mm.sources['min_batched_tokens']})")
    vision_tokens = vision_kept = 0
    if mm is not None and image_tokens and image_encoder_tokens:
        vision_tokens, vision_kept, why = profile_vision(
            mm, image_tokens=image_tokens, image_encoder_tokens=image_encoder_tokens, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
            images_per_prompt=images_per_prompt)
        notes.append(f"{rules.label}: {why}")
    elif multimodal:
        notes.append(f"{rules.label}: the vision encoder's profiling pass is not modelled for this engine version or "
                     "model; only its weights are counted")
    def graphs_at(tp: int) -> int:
        g = rules.by_device(era.cuda_graph_max_batch, memory_gib, device, tp)
        return min(g, max_num_seqs) if era.cuda_graph_max_batch_capped and seqs_given else g

    graph_max = graphs_at(1)
    if era.cuda_graph_max_batch_capped and seqs_given and rules.by_device(era.cuda_graph_max_batch, memory_gib,
                                                                           device) > max_num_seqs:
        notes.append(f"{rules.label}: CUDA graphs up to the {max_num_seqs} sequences asked for "
                     f"({era.sources['cuda_graph_max_batch_capped']})")
    graph_by_tp = tuple((t, graphs_at(t)) for t in (64, 32, 16, 8, 4, 2, 1))
    graph_by_tp = graph_by_tp if any(v != graph_max for _, v in graph_by_tp) else ()
    by_tp: tuple[tuple[int, float], ...] = ()
    by_tp_pipelined: tuple[tuple[int, float], ...] = ()
    if era.accounting == "static_fraction":
        notes.append(f"{rules.label}: a static pool of (free memory at start) x mem_fraction_static holds the weights "
                     f"and the KV cache; activations and CUDA graphs use the rest ({era.sources['accounting']})")
        if gpu_memory_utilization is None:
            reserve = era.static_fraction_reserved
            if reserve is not None:
                prefill_mib, off_for_pp, why = prefill_graphs_reserve(
                    rules, max_num_batched_tokens, max_model_len if context_given else None, mla=mla,
                    multimodal=multimodal, speculative=speculative, enforce_eager=enforce_eager)
                if why:
                    notes.append(why)
                spec_mib = reserve.speculative_after_floor_mib.get(speculative, 0.0) if speculative else 0.0
                if spec_mib:
                    notes.append(f"{rules.label}: the {speculative} draft adds {spec_mib:g} MiB to the reserve after "
                                 f"its floor ({era.sources['static_fraction_reserved']})")
                if enforce_eager and reserve.decode_graphs_term_needs_graphs:
                    notes.append(f"{rules.label}: no decode CUDA graphs, none in the reserve "
                                 f"({era.sources['static_fraction_reserved']})")

                def rows(pg_mib: float) -> tuple[tuple[int, float], ...]:
                    # The reserve grows with the ranks (tp x pp): one row per power-of-two tp, pp 1.
                    return tuple((t, reserve.fraction(memory_gib, max_num_batched_tokens, graphs_at(t), t,
                                                      prefill_graphs_mib=pg_mib, speculative_mib=spec_mib,
                                                      decode_graphs=not enforce_eager))
                                 for t in (64, 32, 16, 8, 4, 2, 1))
                by_tp = rows(prefill_mib)
                if off_for_pp and prefill_mib:
                    by_tp_pipelined = rows(0.0)
                gpu_memory_utilization = by_tp[-1][1]
                notes.append(f"{rules.label}: mem_fraction_static on {device} "
                             + ", ".join(f"{v:g} from tp {t}" for t, v in by_tp if t <= 8)
                             + (" (pp 1; with pp > 1 " + ", ".join(f"{v:g} from tp {t}" for t, v in by_tp_pipelined
                                                                   if t <= 8) + ")" if by_tp_pipelined else "")
                             + f" ({era.sources['static_fraction_reserved']})")
            else:
                assert era.static_fraction_by_tp is not None  # the schema requires one of the two
                by_tp = tuple(sorted(((r.min_tp, r.value) for r in era.static_fraction_by_tp), reverse=True))
                gpu_memory_utilization = era.gpu_memory_utilization
                notes.append(f"{rules.label}: mem_fraction_static by tensor-parallel size, "
                             + ", ".join(f"{v:g} from tp {t}" for t, v in by_tp)
                             + f" ({era.sources['static_fraction_by_tp']})")
    elif gpu_memory_utilization is None:
        gpu_memory_utilization = era.gpu_memory_utilization
        notes.append(f"{rules.label}: {rules.fraction_name} {gpu_memory_utilization:g} by default "
                     f"({era.sources['gpu_memory_utilization']})")
    warm_tokens = 0
    if era.accounting == "warmup":
        notes.append(f"{rules.label}: KV = {era.warmup_free_share:g} x (memory free after a warm-up prefill of "
                     f"{max_num_batched_tokens:,} tokens - (1 - {rules.fraction_name}"
                     + (f" x {era.warmup_total_factor:g}" if era.warmup_total_factor != 1 else "")
                     + f") x device) ({era.sources['accounting']}; {era.sources['warmup_free_share']})")
        if era.warmup_batch == "prefill":
            warm_tokens = max_num_batched_tokens + 1
        elif era.warmup_batch == "requests_at_max_len":
            warm_tokens = -(-max_num_batched_tokens // max(1, max_model_len - 1)) * max_model_len
        if warm_tokens:
            notes.append(f"{rules.label}: the warm-up batch's {warm_tokens:,} tokens of KV are counted back "
                         f"({era.sources['warmup_batch']})")
        if era.prefill_logit_bytes:
            notes.append(f"{rules.label}: the warm-up prefill holds {era.prefill_logit_bytes:g} bytes of logits per "
                         f"token and vocabulary entry ({era.sources['prefill_logit_bytes']})")
        if era.prefill_logit_bytes_gathered:
            notes.append(f"{rules.label}: with tensor parallelism, {era.prefill_logit_bytes_gathered:g} bytes per "
                         f"logit on every shard ({era.sources['prefill_logit_bytes_gathered']})")
        if era.attention_workspace_mib:
            notes.append(f"{rules.label}: {era.attention_workspace_mib:g} MiB of attention workspace held through the "
                         f"warm-up ({era.sources['attention_workspace_mib']})")
        notes.append(f"{rules.label}: {WARMUP_CACHE_NOTE}")
    if era.accounting == "free_fraction":
        notes.append(f"{rules.label}: KV = {rules.fraction_name} x the memory free after the weights and the "
                     f"activation peak of {max_num_batched_tokens:,} tokens ({era.sources['accounting']})")
    if block_size is None:
        block_size = era.block_size
    notes.append(f"{rules.label}: the CUDA context is {'inside' if era.cuda_context_in_budget else 'outside'} the "
                 f"budget ({era.sources['cuda_context_in_budget']})")
    notes.append(f"{rules.label}: CUDA graphs are {'inside' if era.cuda_graphs_in_budget else 'outside'} the budget "
                 f"({era.sources['cuda_graphs_in_budget']})")
    if era.non_torch_gib is not None:
        notes.append(f"{rules.label}: {era.non_torch_gib:g} GiB of non-torch memory beyond the CUDA context and NCCL "
                     f"({era.sources['non_torch_gib']})")
    if graph_max:
        more = ""
        if graph_by_tp:  # where the batch grows with tp: each size it changes at, up to tp 8
            steps = dict(graph_by_tp)
            more = "".join(f", {v} from tp {t}" for t, v in sorted(graph_by_tp) if 1 < t <= 8 and v != steps[t // 2])
        notes.append(f"{rules.label}: decode steps of up to {graph_max} sequences{more} replay CUDA graphs on {device} "
                     f"unless --enforce-eager ({era.sources['cuda_graph_max_batch']})")
    else:
        notes.append(f"{rules.label}: no CUDA graphs ({era.sources['cuda_graph_max_batch']})")
    if era.python_ops_per_layer_parts:
        parts = ", ".join(f"{k} {v:g}" for k, v in era.python_ops_per_layer_parts.items())
        notes.append(f"{rules.label}: Python framework ops of an eager decoder layer by part ({parts}; "
                     f"{era.sources['python_ops_per_layer_parts']}) and {era.python_ops_per_step:g} per step for the "
                     f"logits and the sampler ({era.sources['python_ops_per_step']})")
    else:
        notes.append(f"{rules.label}: {era.python_ops_per_layer:g} Python framework ops per decoder layer in eager mode "
                     f"({era.sources['python_ops_per_layer']}) and {era.python_ops_per_step:g} per step for the logits "
                     f"and the sampler ({era.sources['python_ops_per_step']})")
    if era.accounting == "profiled":
        notes.append(f"{rules.label}: the profiling pass's dummy sampler holds {era.sampler_bytes_per_logit:g} bytes per "
                     f"logit ({era.sources['sampler_bytes_per_logit']})")
    notes.append(f"{rules.label}: {era.step_overhead_us:g} µs of host work per step the GPU waits for "
                 f"({era.sources['step_overhead_us']})")
    if era.batches_in_flight > 1:
        unless = " unless pp > 1" if era.batches_in_flight_pp1_only else ""
        off = "--no-overlap-scheduling to plan without; " if rules.overlap_switch is not None else ""
        notes.append(f"{rules.label}: {OVERLAP_NOTE}{unless}, so under load a request "
                     f"that arrives during a step waits for two ({off}{era.sources['batches_in_flight']})")
    return ServingDefaults(
        max_model_len=max_model_len, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        chunked_prefill=chunked, gpu_memory_utilization=gpu_memory_utilization, block_size=block_size,
        cuda_context_in_budget=era.cuda_context_in_budget, cuda_graphs_in_budget=era.cuda_graphs_in_budget,
        refusal=era.refusal, accounting=era.accounting, static_fraction_by_tp=by_tp,
        python_ops_per_layer=era.python_ops_per_layer, python_ops_per_step=era.python_ops_per_step,
        python_ops_per_layer_parts=tuple(sorted((era.python_ops_per_layer_parts or {}).items())),
        cuda_graph_max_batch=graph_max, step_overhead_seconds=us_to_seconds(era.step_overhead_us),
        sampler_bytes_per_logit=era.sampler_bytes_per_logit,
        non_torch_bytes=None if era.non_torch_gib is None else era.non_torch_gib * BYTES_PER_GIB,
        warmup_free_share=era.warmup_free_share, warmup_total_factor=era.warmup_total_factor,
        warmup_kv_tokens=warm_tokens, prefill_logit_bytes=era.prefill_logit_bytes,
        prefill_logit_bytes_gathered=era.prefill_logit_bytes_gathered,
        attention_workspace_bytes=era.attention_workspace_mib * BYTES_PER_MIB,
        assumptions=tuple(notes), vision_encoder_tokens=vision_tokens, vision_kept_tokens=vision_kept,
        static_fraction_by_tp_pipelined=by_tp_pipelined, cuda_graph_max_batch_by_tp=graph_by_tp,
    )


__all__ = ["ServingDefaults", "chunked_prefill_on", "prefill_graphs_reserve", "profile_vision", "resolve_serving"]
