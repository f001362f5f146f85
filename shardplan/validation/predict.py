"""Each measured case predicted the way a user would ask for its run, and compared.

An engine log is predicted with the engine rules of its version filling what the command line
left out; the device memory is the one the log printed where it printed one (vLLM's
`total_gpu_memory`; SGLang's free memory at start plus the profile's CUDA context). A training
row is predicted with its stack's rules; peak memory is compared by the counter the source
printed (the allocated total for `torch.cuda.max_memory_allocated`, the caching allocator's
reserved peak for nvidia-smi and reserved figures). A fine-tuning row likewise, and a "capacity"
row (the longest sequence that fit on the device) compares the predicted reserved peak at that
length with the device's memory. A serving benchmark run is one replica under the run's traffic
(`cost.serving_load.serve_traffic`, the KV cache from the engine's start-up arithmetic), its
median TTFT, TPOT and ITL (where the run reports them) and output throughput compared in the
group of its engine generation and of its regime: saturated (requests wait in the engine's
queue: rate inf, or more clients than the engine runs at once), or below saturation
(`cost.traffic.is_saturated`, as an estimate decides it).
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from shardplan.cost.accuracy import load_group
from shardplan.cost.estimate import estimate
from shardplan.cost.inputs import inference_workload, training_workload
from shardplan.cost.layout import Layout, PipelineSchedule, Recompute
from shardplan.cost.report import CostReport
from shardplan.errors import ShardplanError
from shardplan.knowledge.load import engine_rules, stack_rules
from shardplan.specs.cluster import cluster
from shardplan.specs.loading import load_hardware, load_model, model_from_data, quiet_notes
from shardplan.specs.model import ModelSpec
from shardplan.specs.hardware import HardwareProfile
from shardplan.units import BYTES_PER_GIB
from shardplan.specs.cases import Case, EngineLogCase, FineTuneCase, ServingLoadCase, TrainingCase
from shardplan.validation.shipped import Skipped, shipped_cases

# Loaded checkpoint formats as the engines name them -> shardplan's weight formats.
QUANTIZATION = {None: None, "fp8": "fp8", "compressed-tensors": "fp8", "gptq_marlin": "int4", "awq_marlin": "int4",
                "gptq": "int4", "awq": "int4", "bitsandbytes-nf4": "int4", "eetq": "int8", "bitsandbytes": "int8"}

# What `torch.cuda.max_memory_allocated` never sees: memory outside PyTorch's allocator.
OUTSIDE_ALLOCATOR = ("overhead.cuda_context", "overhead.non_torch", "overhead.nccl_buffers")


@dataclass(frozen=True)
class Comparison:
    """One predicted quantity of one case against its measurement."""

    case_id: str
    source: str
    kind: str  # engine_log, training, finetune, serving_load
    group: str  # the engine generation (and a serving run's regime), or the stack (and the fine-tuning method)
    version: str | None  # the engine version of an engine log or a serving run
    quantity: str  # kv_capacity, peak_memory, tokens_per_second, start_verdict; ttft_p50, tpot_p50, itl_p50,
    #                output_tokens_per_second (serving runs)
    measured: float
    predicted: float

    @property
    def error(self) -> float:
        """Signed relative error, predicted / measured - 1 (a verdict: 0 right, 1 wrong)."""
        if self.quantity == "start_verdict":
            return float(self.predicted != self.measured)
        return self.predicted / self.measured - 1.0


def case_file_ref(ref: str, corpus: Path | None) -> str:
    """A case's model or profile as given: a bundled name, or a file, whose relative path resolves
    against the folder of the cases (`corpus`; None: as given)."""
    if corpus is not None and ref.endswith((".yaml", ".yml", ".json")) and not Path(ref).is_absolute():
        return str(corpus / ref)
    return ref


def _model(ref: str, corpus: Path | None) -> ModelSpec:
    """A bundled name, or a file: relative paths resolve against the corpus folder."""
    ref = case_file_ref(ref, corpus)
    if corpus is not None and Path(ref).resolve().is_relative_to(SHIPPED_CORPUS):
        with quiet_notes():  # shipped data: its translations' notes are known, not news to the user
            return load_model(ref).spec
    return load_model(ref).spec


# The corpus shardplan ships (validation/shipped.py CORPUS_DIR), whose models load without notes.
SHIPPED_CORPUS = Path(__file__).resolve().parent / "corpus"


def _profile(name: str, corpus: Path | None):
    return load_hardware(case_file_ref(name, corpus))


def logged_device_gib(case: EngineLogCase, profile) -> float | None:
    """The device memory the log shows, GiB: its own total, or (SGLang, whose pool is a fraction of
    the free memory at start) that free memory plus the profile's CUDA context; None: neither."""
    if case.device_total_gib is not None:
        return case.device_total_gib
    if case.device_free_gib is not None:
        return case.device_free_gib + profile.cuda_context_bytes / BYTES_PER_GIB
    return None


def engine_log_inputs(case: EngineLogCase, corpus: Path | None = None):
    """(spec, cluster, layout, workload) of a start-up, as a user would ask for its run."""
    spec = _model(case.model, corpus)
    profile = _profile(case.hardware, corpus)
    if (logged := logged_device_gib(case, profile)) is not None:
        profile = dataclasses.replace(profile, memory_capacity_bytes=round(logged * BYTES_PER_GIB))
    hw = cluster(profile, gpus=case.gpus, nodes=None, gpus_per_node=None)
    f = case.flags
    # Each engine's name for the same input (vLLM, SGLang, TGI).
    fraction = f.gpu_memory_utilization or f.mem_fraction_static or f.cuda_memory_fraction
    max_len = f.max_model_len or f.context_length or f.max_total_tokens
    if max_len is None and f.max_input_tokens:
        max_len = f.max_input_tokens + 1  # TGI: max_total_tokens defaults to max_input_tokens + 1
    batched = f.max_num_batched_tokens or f.chunked_prefill_size or f.max_batch_prefill_tokens
    quant = f.quantization or f.quantize
    if quant not in QUANTIZATION:
        raise ShardplanError(f"quantization {quant!r} is not one shardplan maps", field="flags.quantization",
                             hint=f"use one of {', '.join(q for q in QUANTIZATION if q)}")
    wl = inference_workload(
        max_model_len=max_len, max_num_seqs=f.max_num_seqs, max_num_batched_tokens=batched,
        gpu_memory_utilization=fraction, block_size=None, kv_cache_dtype=f.kv_cache_dtype, weight_dtype=None,
        quantization=QUANTIZATION[quant], enforce_eager=bool(f.enforce_eager), input_len=1024, output_len=128,
        batch_size=None, engine=engine_rules(case.engine, case.engine_version), hw=hw,
        model_max_len=spec.max_position_embeddings, enable_chunked_prefill=f.enable_chunked_prefill,
        vision=spec.vision, images_per_prompt=f.limit_mm_per_prompt, checkpoint_format=spec.shipped_format,
        mla=spec.mla is not None, sliding_window=spec.num_sliding_layers > 0)
    return spec, hw, Layout(tp=case.tp, pp=case.pp), wl


def predict_engine_log(case: EngineLogCase, corpus: Path | None = None) -> CostReport:
    spec, hw, layout, wl = engine_log_inputs(case, corpus)
    return estimate(spec, hw, layout, wl)


def _shape_spec(case: TrainingCase) -> ModelSpec:
    from shardplan.validation.shapes import shape_config  # only shipped rows carry a shape

    assert case.shape is not None  # the schema requires a model or a shape
    spec = model_from_data(shape_config(case.shape), f"shape of {case.id}", case.id).spec
    if case.shape.get("overrides"):
        spec = ModelSpec.model_validate({**spec.model_dump(), **case.shape["overrides"]})
    return spec


def predict_training(case: TrainingCase, corpus: Path | None = None) -> CostReport:
    spec = _model(case.model, corpus) if case.model is not None else _shape_spec(case)
    hw = cluster(_profile(case.hardware, corpus), gpus=case.gpus, nodes=None, gpus_per_node=None)
    dp = case.dp or case.gpus // (case.tp * case.pp * case.cp)
    sp = case.sequence_parallel if case.sequence_parallel is not None else case.stack in ("torchtitan", "megatron")
    layout = Layout(tp=case.tp, pp=case.pp, dp=dp, cp=case.cp, ep=case.ep, zero_stage=case.zero_stage,
                    micro_batch_size=case.micro_batch, recompute=Recompute(case.recompute),
                    sequence_parallel=case.tp > 1 and sp, virtual_stages=case.vp,
                    pp_schedule=PipelineSchedule.INTERLEAVED if case.vp > 1 else PipelineSchedule.ONE_F_ONE_B,
                    pp_embedding_as_layer=case.pp_embedding_as_layer, pp_loss_as_layer=case.pp_loss_as_layer)
    wl = training_workload(seq_len=case.seq_len, global_batch_size=case.global_batch or dp * case.micro_batch,
                           optimizer="adamw", framework=None, flash_attention=case.flash_attention,
                           dropout=case.dropout, stack=stack_rules(case.stack), compile=case.compile,
                           matmul_dtype="fp8" if case.fp8 else None, tp_comm_overlap=case.tp_comm_overlap,
                           compile_loss=case.compile_loss, master_dtype=case.master_dtype,
                           moment_dtype=case.moment_dtype, overlap_grad_reduce=case.overlap_comm,
                           reduce_bucket_size=None if case.reduce_bucket_size is None else str(case.reduce_bucket_size),
                           recompute_modules=None if case.recompute_modules is None else ",".join(case.recompute_modules),
                           spec=spec)
    return estimate(spec, hw, layout, wl)


def predict_finetune(case: FineTuneCase, corpus: Path | None = None) -> CostReport:
    spec = _model(case.model, corpus)
    hw = cluster(_profile(case.hardware, corpus), gpus=case.gpus, nodes=None, gpus_per_node=None)
    layout = Layout(dp=case.gpus, zero_stage=case.zero_stage, micro_batch_size=case.micro_batch,
                    recompute=Recompute(case.recompute))
    wl = training_workload(
        seq_len=case.seq_len, global_batch_size=case.global_batch, optimizer=case.optimizer, framework=None,
        flash_attention=None, dropout=False, stack=stack_rules(case.stack), finetune=case.finetune,
        lora_rank=case.lora_rank, lora_targets=",".join(case.lora_targets), lora_dropout=case.lora_dropout,
        qlora_double_quant=case.double_quant, spec=spec)
    return estimate(spec, hw, layout, wl)


def _scaled(lengths: list[int], total: int) -> list[int]:
    s = sum(lengths)
    return [max(1, round(x * total / s)) for x in lengths] if s else lengths


def serving_load_requests(case: ServingLoadCase, seed: int = 0) -> tuple[tuple[int, int], ...]:
    """(prompt, output) tokens of each request the run's client sent (`ServingLoadCase`), scaled to
    the run's token totals: the lengths are a property of the traffic, not of the engine's speed."""
    n = case.num_requests
    if case.dataset == "sharegpt":
        from shardplan.specs.lengths import load_lengths

        pairs = load_lengths("sharegpt").sample(n, seed)
        ins, outs = [p for p, _ in pairs], [o for _, o in pairs]
    elif case.client == "sglang":  # sample_random_requests: U[1, len] for prompts and outputs
        assert case.input_len is not None and case.output_len is not None  # the schema requires them
        rng = random.Random(seed)
        ins = [rng.randint(1, case.input_len) for _ in range(n)]
        outs = [rng.randint(1, case.output_len) for _ in range(n)]
    else:
        ins = [case.total_input_tokens // n] * n
        outs = [case.total_output_tokens // n] * n
    return tuple(zip(_scaled(ins, case.total_input_tokens), _scaled(outs, case.total_output_tokens)))


def serving_load_inputs(case: ServingLoadCase, corpus: Path | None = None, hw: HardwareProfile | None = None):
    """(spec, hw, layout, workload, traffic) of a serving run, as a user would ask for it; on `hw`
    where given (a profile calibrated from it), else on the profile the case names."""
    from shardplan.cost.serving_load import Traffic

    spec = _model(case.model, corpus)
    hw = hw or _profile(case.hardware, corpus)
    f = case.flags
    wl = inference_workload(
        engine=engine_rules(case.engine, case.engine_version), hw=hw, model_max_len=spec.max_position_embeddings,
        max_model_len=f.max_model_len, max_num_seqs=f.max_num_seqs, max_num_batched_tokens=f.max_num_batched_tokens,
        gpu_memory_utilization=f.gpu_memory_utilization, block_size=None, kv_cache_dtype=None, weight_dtype=None,
        quantization=case.quantization, enforce_eager=bool(f.enforce_eager), input_len=1024, output_len=128,
        batch_size=None, checkpoint_format=spec.shipped_format,
        overlap_scheduling=f.async_scheduling if f.async_scheduling is not None
        else None if f.disable_overlap_schedule is None else not f.disable_overlap_schedule)
    traffic = Traffic(requests=serving_load_requests(case), max_concurrency=case.max_concurrency,
                      request_rate_per_second=math.inf if case.request_rate_per_second is None
                      else case.request_rate_per_second)
    return spec, hw, Layout(tp=case.tp, pp=case.pp, dp=1, ep=case.ep), wl, traffic


def predict_serving_load(case: ServingLoadCase, corpus: Path | None = None, hw: HardwareProfile | None = None):
    """The run's LoadResult (with its inter-token gaps) and whether the replica is saturated under
    it (on `hw` where given, as `serving_load_inputs`). Raises ShardplanError where the deployment does not start as shardplan sizes it, or the
    engine would refuse the run's requests (nothing to compare)."""
    from shardplan.cost.memory_serving import serving_memory
    from shardplan.cost.serving_load import scheduler_for, simulate_replica
    from shardplan.cost.step_model import StepModel
    from shardplan.cost.traffic import is_saturated, saturated_whatever_the_capacity, saturation_rate, sequence_slots

    spec, hw, layout, wl, traffic = serving_load_inputs(case, corpus, hw)
    longest = max(p + o for p, o in traffic.requests)
    context = wl.max_model_len or spec.max_position_embeddings
    if longest > context:
        raise ShardplanError(f"its requests reach {longest:,} tokens, past max_model_len {context:,}: the engine "
                             "would refuse them", field="total_input_tokens",
                             hint="check the token totals and num_requests, or set flags.max_model_len")
    sm = serving_memory(spec, hw, layout, wl)
    if not sm.fits:
        raise ShardplanError(f"does not start as shardplan sizes it: {sm.reason}")
    step = StepModel(spec, hw, layout, wl, wl.max_num_batched_tokens, wl.max_num_seqs)
    sched = scheduler_for(wl, sm.kv_account, layout.pp)
    result = simulate_replica(step, sched, traffic, itl=True)
    if result.num_refused:
        raise ShardplanError(f"{result.num_refused:,} of its {len(traffic.requests):,} requests are longer than the KV "
                             "cache holds: the engine would refuse them", field="total_input_tokens",
                             hint="check the token totals and num_requests")
    n = len(traffic.requests)
    rate, conc = traffic.request_rate_per_second, traffic.max_concurrency
    known = saturated_whatever_the_capacity(rate, conc, n, result.peak_running)
    if known is not None:  # a burst, or clients capped: the verdict without simulating the saturation rate
        return result, known
    slots = sequence_slots(wl, sm.kv_account, sum(p + o for p, o in traffic.requests) / n)
    capacity = saturation_rate(step, sched, traffic, slots, result)  # as an estimate reads its own
    return result, is_saturated(rate, conc, n, result.peak_running, capacity)


def _peak(report: CostReport, counter: str) -> float:
    """The predicted peak by the counter the source printed, bytes, on the rank that peaks."""
    rank = max(report.memory.per_rank, key=lambda r: r.reserved_bytes)
    if counter == "allocated":
        return rank.per_gpu_bytes["total"] - sum(rank.detail_bytes.get(k, 0.0) for k in OUTSIDE_ALLOCATOR)
    return rank.reserved_bytes


def compare(case: Case, corpus: Path | None = None) -> list[Comparison]:
    """The case's measured quantities against the prediction. Raises ShardplanError for a case
    the model refuses (an unknown model, a layout it cannot run)."""
    base = dict(case_id=case.id, source=case.source, kind=case.kind)
    if isinstance(case, EngineLogCase):
        rules = engine_rules(case.engine, case.engine_version)
        rep = predict_engine_log(case, corpus)
        group = dict(base, group=rules.era.generation, version=rules.version)
        out = [Comparison(**group, quantity="start_verdict", measured=float(case.started), predicted=float(rep.fits))]
        if case.kv_cache_tokens:
            out.append(Comparison(**group, quantity="kv_capacity", measured=float(case.kv_cache_tokens),
                                  predicted=float(rep.kv_cache.capacity_tokens)))
        return out
    if isinstance(case, TrainingCase):
        rep = predict_training(case, corpus)
        group = dict(base, group=case.stack, version=None)
        out = []
        m = case.measured
        if m.peak_memory_gib is not None:
            out.append(Comparison(**group, quantity="peak_memory", measured=m.peak_memory_gib * BYTES_PER_GIB,
                                  predicted=_peak(rep, m.memory_counter)))
        if m.tokens_per_second_per_gpu is not None:
            out.append(Comparison(**group, quantity="tokens_per_second", measured=m.tokens_per_second_per_gpu,
                                  predicted=rep.time.tokens_per_second_per_gpu))
        return out
    if isinstance(case, ServingLoadCase):
        rules = engine_rules(case.engine, case.engine_version)
        result, saturated = predict_serving_load(case, corpus)
        group = dict(base, group=load_group(rules.era.generation, saturated), version=rules.version)
        m = case.measured
        out = [Comparison(**group, quantity="ttft_p50", measured=m.median_ttft_ms / 1e3,
                          predicted=result.ttft_seconds.p50)]
        if m.median_tpot_ms is not None and result.tpot_seconds.p50 == result.tpot_seconds.p50:  # NaN: no TPOT
            out.append(Comparison(**group, quantity="tpot_p50", measured=m.median_tpot_ms / 1e3,
                                  predicted=result.tpot_seconds.p50))
        itl = result.itl_seconds
        if m.median_itl_ms is not None and itl is not None and itl.p50 == itl.p50:  # NaN: no decode step
            out.append(Comparison(**group, quantity="itl_p50", measured=m.median_itl_ms / 1e3, predicted=itl.p50))
        out.append(Comparison(**group, quantity="output_tokens_per_second", measured=m.output_tokens_per_second,
                              predicted=result.output_tokens_per_second))
        return out
    rep = predict_finetune(case, corpus)
    group = dict(base, group=f"{case.stack} {case.finetune}", version=None)
    if case.counter == "capacity":  # the run filled the device: its memory is what was measured
        device = float(_profile(case.hardware, corpus).memory_capacity_bytes)
        return [Comparison(**group, quantity="peak_memory", measured=device, predicted=_peak(rep, "reserved"))]
    assert case.measured_bytes is not None  # the schema requires it for allocated and reserved
    return [Comparison(**group, quantity="peak_memory", measured=case.measured_bytes,
                       predicted=_peak(rep, case.counter))]


# What the search chooses for a training run (its layout); two runs that differ in nothing else compare layouts.
LAYOUT_FIELDS = ("tp", "pp", "dp", "cp", "ep", "vp", "sequence_parallel", "zero_stage", "micro_batch", "recompute")
PAIRS_GROUP = "layouts"  # pooled over stacks: each has a few such pairs


def _setting(case: TrainingCase) -> tuple[str, str]:
    """What two training runs must share to compare their layouts: where they were published (the
    document, or the repository at one commit: its CI's golden values are one software build) and
    every field of the case but its id, source, layout and measurement."""
    url = case.source.split(" (")[0]
    commit = re.match(r"(https://github\.com/[^/]+/[^/]+/(?:blob|tree)/[0-9a-f]{7,40})/", url)
    fields = case.model_dump(mode="json", exclude={"id", "source", "measured", *LAYOUT_FIELDS})
    return commit.group(1) if commit else url, json.dumps(fields, sort_keys=True)


def layout_pairs(predicted: list[tuple[Case, Comparison]]) -> list[Comparison]:
    """The model's error in comparing two layouts of one setting: for each training run, against the
    measured-fastest run of the same publication, model, GPUs, sequence length, batch and stack
    features that differs from it only in layout (LAYOUT_FIELDS), the predicted ratio of the two
    runs' tokens/s per GPU against the measured one, the faster first (`predicted`: each run's tokens/s
    comparison). What every layout of a setting shares (the GPU's real efficiency, the stack's
    overheads, the model's own bias on that model) cancels in the ratio, so this is the error a ranking
    of layouts makes, smaller than the error of either figure (`shardplan validate`, group "layouts");
    the search's ties are plans within its band of each other (`tasks/_bands.py`). One pair a run
    (against the setting's fastest, the one a ranking must find), so a cases file of n runs makes
    fewer than n pairs."""
    by_setting: dict[tuple[str, str], list[tuple[TrainingCase, Comparison]]] = {}
    for case, c in predicted:
        if isinstance(case, TrainingCase) and c.quantity == "tokens_per_second":
            by_setting.setdefault(_setting(case), []).append((case, c))
    out = []
    for runs in by_setting.values():
        runs.sort(key=lambda r: (-r[1].measured, r[0].id))
        (a, ca), rest = runs[0], runs[1:]
        for b, cb in rest:
            if all(getattr(a, f) == getattr(b, f) for f in LAYOUT_FIELDS):
                continue  # the same layout as the cases state it: what differs (a schedule) is not expressed
            out.append(Comparison(case_id=f"{a.id} vs {b.id}", source=f"{a.source}; {b.source}", kind="training",
                                  group=PAIRS_GROUP, version=None, quantity="layout_speed_ratio",
                                  measured=ca.measured / cb.measured, predicted=ca.predicted / cb.predicted))
    return out


@dataclass(frozen=True)
class Predicted:
    """A shipped case with its comparisons, or the reason the model refuses it."""

    case: Case
    comparisons: tuple[Comparison, ...]
    refused: str | None = None


@lru_cache(maxsize=2)
def shipped_predictions(corpus: Path) -> tuple[tuple[Predicted, ...], tuple[Skipped, ...]]:
    """Every shipped case predicted, and the shipped rows without a complete case: once per process
    (`validate`'s filters and the error bands read the same figures; a run of the whole corpus takes
    seconds)."""
    cases, skipped = shipped_cases(corpus)
    out = []
    for case in cases:
        try:
            out.append(Predicted(case, tuple(compare(case, corpus))))
        except ShardplanError as e:
            out.append(Predicted(case, (), e.message))
    return tuple(out), tuple(skipped)


__all__ = ["Comparison", "LAYOUT_FIELDS", "PAIRS_GROUP", "Predicted", "QUANTIZATION", "compare", "layout_pairs", "engine_log_inputs", "logged_device_gib",
           "predict_engine_log", "predict_finetune", "predict_serving_load", "predict_training", "serving_load_inputs",
           "serving_load_requests", "shipped_predictions"]
