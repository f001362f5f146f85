"""An inference engine's own start-up log, read as data: the memory figures vLLM, SGLang and
TGI print while they size their KV cache, each with the line it came from.

Pure: `parse_engine_log(text, source)` works on a string; `read_engine_log(path)` reads the file
through `fileio.read_regular_file_bytes` (capped at MAX_LOG_BYTES) first.

Units as the engines print them (everything here is converted once, to bytes):
- vLLM prints "GiB" in its profiling summaries, and "GB" in `Loading model weights took %.4f GB`,
  which is GiB too: it divides by `float(2**30)` (vllm/worker/model_runner.py, `load_model`;
  vLLM issue "the unit displayed by model_runner.py" asks to rename it).
- SGLang's "GB" is GiB: `get_available_gpu_memory` returns `free_gpu_memory / (1 << 30)`
  (python/sglang/srt/utils.py), and its "mem usage" figures are differences of those.
- TGI prints token counts only (`Setting max batch total tokens to N`).

Hostile input is bounded: at most MAX_LOG_BYTES are read; NUL bytes or invalid UTF-8 are
refused; ANSI colour codes are stripped; lines longer than MAX_LINE_CHARS are skipped (and
counted) before any pattern sees them; at most MAX_CANDIDATE_LINES lines that name a memory
keyword are examined. Lines are found by a few literal anchors (str.find), and every
pattern is a literal keyword with bounded number groups and no nested quantifiers, so matching
is linear in the line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Literal

from pydantic import Field

from shardplan import fileio
from shardplan.errors import InputFileError
from shardplan.specs._base import StrictModel
from shardplan.units import gib_to_bytes

MAX_LOG_BYTES = 64 * 1024 * 1024
MAX_LINE_CHARS = 64 * 1024
MAX_CANDIDATE_LINES = 100_000  # a start-up log has tens; a day of periodic stats lines stays far below
NUL = b"\x00"
VLLM_HASH_LINES = ("# GPU blocks", "# CUDA blocks")  # vLLM lines that start with '#'

Engine = Literal["vllm", "sglang", "tgi"]
# Which log format the matched lines belong to (a hint, not a version):
#   vllm-v0-0.6.4    V0 "Memory profiling results: total_gpu_memory=... peak_torch_memory=..." (PR #9352)
#   vllm-v0.6.5+/v1  "model weights take ...; non_torch_memory takes ...; PyTorch activation peak memory
#                    takes ..." (PR #10511), printed by V0 from 0.6.5 and by V1
#   vllm-v1          V1-only lines: "Available KV cache memory", "GPU KV cache size", "Model loading took"
#   vllm-v0          V0-only lines without a profiling summary: "# GPU blocks", "max seq len (L) is larger"
#   vllm             only lines both engines print
Generation = Literal["vllm-v0-0.6.4", "vllm-v0.6.5+/v1", "vllm-v1", "vllm-v0", "vllm", "sglang", "tgi"]
# The most telling format wins.
GENERATION_ORDER: tuple[Generation, ...] = ("vllm-v0-0.6.4", "vllm-v0.6.5+/v1", "vllm-v1", "vllm-v0")
ENGINE_NAMES: dict[str, str] = {"vllm": "vLLM", "sglang": "SGLang", "tgi": "TGI"}

# A number as engines print it: digits with optional thousands separators and decimals, bounded.
_NUM = r"(?:\d{1,3}(?:,\d{3}){1,8}(?![\d,])|\d{1,24})(?:\.\d{1,12})?"  # 1,234,567 or 1234567, not '105531,'
_ANSI = re.compile(r"\x1b\[[0-9;?]{0,32}[ -/]{0,8}[@-~]|\x1b[@-Z\\-_]")


class Unit(str, Enum):
    """How a printed number turns into the field's value."""

    GIB = "GiB"  # vLLM's "GB"/"GiB" and SGLang's "GB": 2**30 bytes -> bytes
    COUNT = "count"  # tokens, blocks, requests -> int
    FRACTION = "fraction"  # gpu_memory_utilization, mem_fraction_static -> float
    RATIO = "ratio"  # "1.56x" -> float


@dataclass(frozen=True)
class LinePattern:
    """One line an engine prints: a literal `keyword` (a cheap pre-filter), the regex with one
    named group per figure, the EngineLog field and unit of each group, and where it comes from."""

    engine: Engine
    keyword: str
    regex: re.Pattern[str]
    fields: tuple[tuple[str, Unit], ...]  # (group name == EngineLog field, unit)
    since: str  # engine versions that print it, and the source
    generation: Generation | None = None  # the format it implies; None: printed by several

    def __post_init__(self) -> None:
        assert set(self.regex.groupindex) == {f for f, _ in self.fields}, self.regex.pattern  # a table typo


def _p(engine: Engine, keyword: str, pattern: str, fields: tuple[tuple[str, Unit], ...], since: str,
       generation: Generation | None = None) -> LinePattern:
    return LinePattern(engine, keyword, re.compile(pattern), fields, since, generation)


G, C, F, R = Unit.GIB, Unit.COUNT, Unit.FRACTION, Unit.RATIO

VLLM_PATTERNS: tuple[LinePattern, ...] = (
    _p("vllm", "Loading model weights took", rf"Loading model weights took (?P<weights_bytes>{_NUM}) ?GB",
       (("weights_bytes", G),), "V0 model_runner.py load_model (GB means GiB); early V1"),
    _p("vllm", "Model loading took", rf"Model loading took (?P<weights_bytes>{_NUM}) ?Gi?B",
       (("weights_bytes", G),), "V1 gpu_model_runner.py load_model", "vllm-v1"),
    # V0 0.6.4 (worker.py determine_num_available_blocks, PR #9352): one key=value summary line.
    _p("vllm", "total_gpu_memory=", rf"\btotal_gpu_memory=(?P<total_gpu_memory_bytes>{_NUM})GiB",
       (("total_gpu_memory_bytes", G),), "V0 0.6.4 'Memory profiling results'", "vllm-v0-0.6.4"),
    _p("vllm", "peak_torch_memory=", rf"\bpeak_torch_memory=(?P<peak_torch_bytes>{_NUM})GiB",
       (("peak_torch_bytes", G),), "V0 0.6.4 'Memory profiling results' (weights + activation peak)",
       "vllm-v0-0.6.4"),
    _p("vllm", "non_torch_memory=", rf"\bnon_torch_memory=(?P<non_torch_bytes>{_NUM})GiB",
       (("non_torch_bytes", G),), "V0 0.6.4 'Memory profiling results'", "vllm-v0-0.6.4"),
    _p("vllm", "kv_cache_size=", rf"\bkv_cache_size=(?P<kv_cache_bytes>{_NUM})GiB",
       (("kv_cache_bytes", G),), "V0 0.6.4 'Memory profiling results'", "vllm-v0-0.6.4"),
    _p("vllm", "gpu_memory_utilization=", rf"\bMemory profiling results:.{{0,400}}?\bgpu_memory_utilization=(?P<gpu_memory_utilization>{_NUM})",
       (("gpu_memory_utilization", F),), "V0 0.6.4 'Memory profiling results'", "vllm-v0-0.6.4"),
    # V0 >= 0.6.5 and V1 (PR #10511, worker.py / gpu_worker.py): budget line, then the split.
    _p("vllm", ") x gpu_memory_utilization (",
       rf"total_gpu_memory \((?P<total_gpu_memory_bytes>{_NUM}) ?GiB\) x gpu_memory_utilization "
       rf"\((?P<gpu_memory_utilization>{_NUM})\) = (?P<budget_bytes>{_NUM}) ?GiB",
       (("total_gpu_memory_bytes", G), ("gpu_memory_utilization", F), ("budget_bytes", G)),
       "V0 >= 0.6.5, V1 (PR #10511)", "vllm-v0.6.5+/v1"),
    _p("vllm", "model weights take", rf"model weights take (?P<weights_bytes>{_NUM}) ?GiB",
       (("weights_bytes", G),), "V0 >= 0.6.5, V1", "vllm-v0.6.5+/v1"),
    _p("vllm", "non_torch_memory takes", rf"non_torch_memory takes (?P<non_torch_bytes>{_NUM}) ?GiB",
       (("non_torch_bytes", G),), "V0 >= 0.6.5, V1", "vllm-v0.6.5+/v1"),
    _p("vllm", "activation peak memory takes",
       rf"activation peak memory takes (?P<activation_peak_bytes>{_NUM}) ?GiB",
       (("activation_peak_bytes", G),), "V0 >= 0.6.5, V1", "vllm-v0.6.5+/v1"),
    _p("vllm", "reserved for KV Cache is", rf"reserved for KV Cache is (?P<kv_cache_bytes>{_NUM}) ?GiB",
       (("kv_cache_bytes", G),), "V0 >= 0.6.5, V1", "vllm-v0.6.5+/v1"),
    _p("vllm", "Memory profiling takes", r"Memory profiling takes (?P<profiling_seconds>\d{1,9}(?:\.\d{1,9})?) seconds",
       (("profiling_seconds", F),), "V0 >= 0.6.5, V1", "vllm-v0.6.5+/v1"),
    # V1 >= 0.10.2 (gpu_worker.py compile_or_warm_up_model): the budget's split after graph capture.
    _p("vllm", "Free memory on device (", rf"Free memory on device \({_NUM}/(?P<total_gpu_memory_bytes>{_NUM}) ?GiB\) on startup",
       (("total_gpu_memory_bytes", G),), "V1 >= 0.10.2 gpu_worker.py", "vllm-v1"),
    _p("vllm", "GiB for peak activation",
       rf"Actual usage is {_NUM} ?GiB for weight, (?P<activation_peak_bytes>{_NUM}) ?GiB for peak activation, "
       rf"(?P<non_torch_bytes>{_NUM}) ?GiB for non-torch memory, and (?P<cuda_graph_bytes>{_NUM}) ?GiB for CUDAGraph memory",
       (("activation_peak_bytes", G), ("non_torch_bytes", G), ("cuda_graph_bytes", G)),
       "V1 >= 0.10.2 gpu_worker.py", "vllm-v1"),
    _p("vllm", "Available KV cache memory", rf"Available KV cache memory: (?P<kv_cache_bytes>{_NUM}) ?GiB",
       (("kv_cache_bytes", G),), "V1 gpu_worker.py", "vllm-v1"),
    _p("vllm", "GPU KV cache size", rf"GPU KV cache size: (?P<kv_cache_tokens>{_NUM}) tokens",
       (("kv_cache_tokens", C),), "V1 kv_cache_utils.py", "vllm-v1"),
    # V0 executors; the 20k RTX 3090 log lost the leading '#', and V0 0.6.6+ says "CUDA blocks".
    _p("vllm", " blocks: ", rf"(?:GPU|CUDA) blocks: (?P<num_gpu_blocks>{_NUM}), # CPU blocks: (?P<num_cpu_blocks>{_NUM})",
       (("num_gpu_blocks", C), ("num_cpu_blocks", C)), "V0 llm_engine.py / executor_base.py", "vllm-v0"),
    _p("vllm", "Maximum concurrency for",
       rf"Maximum concurrency for (?P<max_concurrency_tokens_per_request>{_NUM}) tokens per request: "
       rf"(?P<max_concurrency>{_NUM})x",
       (("max_concurrency_tokens_per_request", C), ("max_concurrency", R)), "V0 >= 0.6.4, V1"),
    _p("vllm", "Graph capturing finished", rf"Graph capturing finished in \d{{1,9}} secs?, took (?P<cuda_graph_bytes>{_NUM}) ?GiB",
       (("cuda_graph_bytes", G),), "V0 >= 0.6.5, V1 (model_runner capture_model)"),
    _p("vllm", "max seq len", rf"model's max seq len \((?P<refusal_max_model_len>{_NUM})\) is larger than the maximum "
       rf"number of tokens that can be stored in KV cache \((?P<refusal_kv_tokens>{_NUM})\)",
       (("refusal_max_model_len", C), ("refusal_kv_tokens", C)), "V0 worker.py raise_if_cache_size_invalid",
       "vllm-v0"),
    _p("vllm", "To serve at least one request",
       rf"To serve at least one request with the models?'s max seq len \((?P<refusal_max_model_len>{_NUM})\), "
       rf"\((?P<refusal_needed_bytes>{_NUM}) ?GiB KV cache is needed, which is larger than the available KV cache "
       rf"memory \((?P<refusal_available_bytes>{_NUM}) ?GiB\)",
       (("refusal_max_model_len", C), ("refusal_needed_bytes", G), ("refusal_available_bytes", G)),
       "V1 kv_cache_utils.py check_enough_kv_cache_memory", "vllm-v1"),
    _p("vllm", "estimated maximum model length is",
       rf"estimated maximum model length is (?P<refusal_estimated_max_model_len>{_NUM})",
       (("refusal_estimated_max_model_len", C),), "V1 kv_cache_utils.py (>= 0.9)", "vllm-v1"),
)

SGLANG_PATTERNS: tuple[LinePattern, ...] = (
    _p("sglang", "mem_fraction_static=", rf"\bmem_fraction_static=(?P<mem_fraction_static>{_NUM})",
       (("mem_fraction_static", F),), "ServerArgs dump (server_args=ServerArgs(...))", "sglang"),
    _p("sglang", "Load weight begin", rf"Load weight begin\. avail mem=(?P<avail_mem_before_weights_bytes>{_NUM}) ?GB",
       (("avail_mem_before_weights_bytes", G),), "model_runner.py load_model", "sglang"),
    _p("sglang", "Load weight end", rf"Load weight end\..{{0,400}}?avail mem=(?P<avail_mem_after_weights_bytes>{_NUM}) ?GB",
       (("avail_mem_after_weights_bytes", G),), "model_runner.py load_model", "sglang"),
    _p("sglang", "Load weight end", rf"Load weight end\..{{0,400}}?mem usage=(?P<weights_bytes>{_NUM}) ?GB",
       (("weights_bytes", G),), "model_runner.py load_model (>= 0.4.3; earlier releases print no usage)", "sglang"),
    _p("sglang", "KV Cache is allocated", rf"KV Cache is allocated\. #tokens: (?P<kv_cache_tokens>{_NUM}),",
       (("kv_cache_tokens", C),), "mem_cache/memory_pool.py (>= 0.4.3)", "sglang"),
    _p("sglang", "KV Cache is allocated", rf"KV Cache is allocated\.(?: #tokens: {_NUM},)? "
       rf"K size: (?P<k_cache_bytes>{_NUM}) ?GB, V size: (?P<v_cache_bytes>{_NUM}) ?GB",
       (("k_cache_bytes", G), ("v_cache_bytes", G)), "mem_cache/memory_pool.py (>= 0.4.1)", "sglang"),
    _p("sglang", "Memory pool end", rf"Memory pool end\. avail mem=(?P<avail_mem_after_kv_bytes>{_NUM}) ?GB",
       (("avail_mem_after_kv_bytes", G),), "model_runner.py init_memory_pool", "sglang"),
    _p("sglang", "Capture cuda graph end", rf"Capture cuda graph end\..{{0,200}}?mem usage=(?P<cuda_graph_bytes>{_NUM}) ?GB",
       (("cuda_graph_bytes", G),), "cuda_graph_runner.py", "sglang"),
    _p("sglang", "max_total_num_tokens=", rf"\bmax_total_num_tokens=(?P<max_total_num_tokens>{_NUM})",
       (("max_total_num_tokens", C),), "scheduler.py (after the pool is sized)", "sglang"),
    _p("sglang", "max_running_requests=", rf"max_prefill_tokens=\d{{1,12}}, max_running_requests=(?P<max_running_requests>{_NUM})",
       (("max_running_requests", C),), "scheduler.py", "sglang"),
    _p("sglang", "context_len=", rf"max_total_num_tokens=.{{0,200}}?\bcontext_len=(?P<context_len>{_NUM})",
       (("context_len", C),), "scheduler.py", "sglang"),
    _p("sglang", "exceeds the maximum allowed length",
       rf"Input length \((?P<request_input_tokens>{_NUM}) tokens\) exceeds the maximum allowed length "
       rf"\((?P<max_allowed_input_tokens>{_NUM}) tokens\)",
       (("request_input_tokens", C), ("max_allowed_input_tokens", C)),
       "scheduler.py (request time; the cap derives from max_total_num_tokens)", "sglang"),
)

TGI_PATTERNS: tuple[LinePattern, ...] = (
    _p("tgi", "Setting max batch total tokens to", rf"Setting max batch total tokens to (?P<max_batch_total_tokens>{_NUM})",
       (("max_batch_total_tokens", C),), "router (after warm-up infers it from free memory)", "tgi"),
    _p("tgi", "but tgi will now set its default to",
       rf"Model supports up to (?P<model_max_tokens>{_NUM}) but tgi will now set its default to (?P<default_max_total_tokens>{_NUM})",
       (("model_max_tokens", C), ("default_max_total_tokens", C)), "launcher (>= 2.3)", "tgi"),
    _p("tgi", "Default `max_total_tokens` to", rf"Default `max_total_tokens` to (?P<default_max_total_tokens>{_NUM})",
       (("default_max_total_tokens", C),), "launcher (2.x)", "tgi"),
    _p("tgi", "cuda_memory_fraction", rf"\bcuda_memory_fraction: (?P<cuda_memory_fraction>{_NUM})",
       (("cuda_memory_fraction", F),), "launcher Args dump (--cuda-memory-fraction)", "tgi"),
)

PATTERNS: dict[Engine, tuple[LinePattern, ...]] = {"vllm": VLLM_PATTERNS, "sglang": SGLANG_PATTERNS, "tgi": TGI_PATTERNS}
_ALL = tuple(p for table in PATTERNS.values() for p in table)
# Substrings every pattern's line holds (each pattern's keyword contains one, or its regex
# requires one): a line with none of them is never examined. Few, so the scan stays fast.
ANCHORS: tuple[str, ...] = ("LLM engine (v", "GiB", "GB", "blocks: ", "KV cache size", "tokens per request", "max batch total tokens",
                            "max_total_tokens", "but tgi will", "max_total_num_tokens", "mem_fraction_static",
                            "cuda_memory_fraction", "max seq len", "Memory profiling", "estimated maximum",
                            "allowed length")

# Figures every rank prints (vLLM V1 workers, one 'GPU KV cache size' line per rank): the engine
# sizes its cache by the smallest, so the smallest is the log's figure.
PER_RANK_MIN_FIELDS = frozenset({"kv_cache_bytes", "kv_cache_tokens", "num_gpu_blocks", "max_concurrency"})

# vLLM prints its version when the engine starts: "Initializing a V1 LLM engine (v0.10.2) with config"
# (V1), "Initializing an LLM engine (v0.6.4) with config" (V0).
_VERSION_LINE = re.compile(r"LLM engine \(v(\d{1,4}\.\d{1,4}(?:\.\d{1,4})?(?:[.+\w]{0,40})?)\)")

# The figures that say how large the KV cache came out: a start-up log without one is cut short.
CAPACITY_FIELDS: dict[Engine, tuple[str, ...]] = {
    "vllm": ("kv_cache_bytes", "kv_cache_tokens", "num_gpu_blocks", "refusal_kv_tokens", "refusal_available_bytes"),
    "sglang": ("kv_cache_tokens", "max_total_num_tokens", "max_allowed_input_tokens"),
    "tgi": ("max_batch_total_tokens",),
}
CAPACITY_LINES: dict[Engine, str] = {
    "vllm": "'# GPU blocks', 'GPU KV cache size', 'Available KV cache memory', 'kv_cache_size=', "
            "'reserved for KV Cache is' or a 'max seq len' refusal",
    "sglang": "'KV Cache is allocated' or 'max_total_num_tokens='",
    "tgi": "'Setting max batch total tokens to'",
}


class IntTerm(StrictModel):
    """A figure that is a whole number (bytes, tokens, blocks), with the line it came from."""

    value: int = Field(ge=0, description="the figure in the field's unit (bytes, tokens or a count)")
    line: int = Field(ge=1, description="1-based line number in the log")
    printed: str = Field(description="the number as the engine printed it, with its unit")


class FloatTerm(StrictModel):
    """A fraction or a ratio, with the line it came from."""

    value: float = Field(ge=0, description="the figure (a fraction or a ratio)")
    line: int = Field(ge=1, description="1-based line number in the log")
    printed: str = Field(description="the number as the engine printed it")


def _i(description: str) -> object:
    return Field(None, description=description)


class EngineLog(StrictModel):
    """What an engine's start-up log says about memory, in SI units. Every figure is the first
    the log prints (the driver or rank 0); None: the log does not print it."""

    source: str = Field(description="the log file")
    engine: Engine = Field(description="the engine whose lines were found")
    generation: Generation = Field(description="the log format the matched lines belong to (a hint)")
    num_lines: int = Field(ge=0, description="lines in the log")
    num_long_lines_skipped: int = Field(ge=0, description=f"lines over {MAX_LINE_CHARS} characters, not examined")
    engine_version: str | None = Field(None, description="the version the engine prints at start-up (vLLM's "
                                                        "'Initializing ... LLM engine (vX.Y.Z)'); None: not printed")
    # vLLM
    total_gpu_memory_bytes: IntTerm | None = _i("device memory as torch sees it, bytes")
    gpu_memory_utilization: FloatTerm | None = _i("the share of device memory vLLM may use (fraction)")
    budget_bytes: IntTerm | None = _i("total_gpu_memory x gpu_memory_utilization as printed (vLLM >= 0.6.5), bytes")
    weights_bytes: IntTerm | None = _i("model weights on this GPU, bytes (vLLM: rotary cache included; SGLang: mem usage of the load)")
    peak_torch_bytes: IntTerm | None = _i("vLLM 0.6.4: torch's peak in the profiling pass, weights included, bytes")
    activation_peak_bytes: IntTerm | None = _i("vLLM >= 0.6.5: torch's activation peak in the profiling pass, bytes")
    non_torch_bytes: IntTerm | None = _i("memory torch does not allocate (NCCL, cuBLAS workspaces), bytes")
    kv_cache_bytes: IntTerm | None = _i("memory for the KV cache on this GPU, bytes (SGLang: K size + V size)")
    kv_cache_tokens: IntTerm | None = _i("tokens the KV cache holds (vLLM V1 'GPU KV cache size', SGLang '#tokens')")
    num_gpu_blocks: IntTerm | None = _i("vLLM V0 paged KV blocks on the GPU (count)")
    num_cpu_blocks: IntTerm | None = _i("vLLM V0 swap blocks in CPU memory (count)")
    max_concurrency: FloatTerm | None = _i("max_model_len sequences the cache holds at once (ratio)")
    max_concurrency_tokens_per_request: IntTerm | None = _i("the max_model_len that ratio is for, tokens")
    cuda_graph_bytes: IntTerm | None = _i("memory the CUDA-graph capture took, bytes")
    profiling_seconds: FloatTerm | None = _i("vLLM >= 0.6.5: the profiling pass, seconds")
    refusal_max_model_len: IntTerm | None = _i("refused: the max_model_len that did not fit, tokens")
    refusal_kv_tokens: IntTerm | None = _i("vLLM V0 refusal: tokens the cache could hold")
    refusal_needed_bytes: IntTerm | None = _i("vLLM V1 refusal: KV bytes one max_model_len sequence needs")
    refusal_available_bytes: IntTerm | None = _i("vLLM V1 refusal: KV bytes available")
    refusal_estimated_max_model_len: IntTerm | None = _i("vLLM V1 refusal: the longest max_model_len that fits, tokens")
    # SGLang
    mem_fraction_static: FloatTerm | None = _i("SGLang: share of device memory for weights and KV pool (fraction)")
    avail_mem_before_weights_bytes: IntTerm | None = _i("SGLang: free device memory before loading weights, bytes")
    avail_mem_after_weights_bytes: IntTerm | None = _i("SGLang: free device memory after loading weights, bytes")
    avail_mem_after_kv_bytes: IntTerm | None = _i("SGLang: free device memory after the KV pool, bytes")
    k_cache_bytes: IntTerm | None = _i("SGLang: the K half of the KV pool, bytes")
    v_cache_bytes: IntTerm | None = _i("SGLang: the V half of the KV pool, bytes")
    max_total_num_tokens: IntTerm | None = _i("SGLang: tokens the KV pool holds")
    max_running_requests: IntTerm | None = _i("SGLang: requests scheduled at once (count)")
    context_len: IntTerm | None = _i("SGLang: the context length it serves, tokens")
    request_input_tokens: IntTerm | None = _i("SGLang: a request that was too long, tokens")
    max_allowed_input_tokens: IntTerm | None = _i("SGLang: the request-length cap it derives from the pool, tokens")
    # TGI
    max_batch_total_tokens: IntTerm | None = _i("TGI: tokens in flight the warm-up found room for")
    model_max_tokens: IntTerm | None = _i("TGI: the model's own maximum length, tokens")
    default_max_total_tokens: IntTerm | None = _i("TGI: the max_total_tokens it defaulted to, tokens")
    cuda_memory_fraction: FloatTerm | None = _i("TGI: --cuda-memory-fraction (fraction)")

    @property
    def refused(self) -> bool:
        """The engine refused to start: the max_model_len does not fit its KV cache."""
        return self.refusal_max_model_len is not None

    def found(self) -> list[str]:
        """Names of the figures the log printed, in field order."""
        return [n for n, f in type(self).model_fields.items()
                if f.annotation in (IntTerm | None, FloatTerm | None) and getattr(self, n) is not None]


def _term(raw: str, unit: Unit, line: int, printed: str) -> IntTerm | FloatTerm:
    number = float(raw.replace(",", ""))
    if unit is Unit.GIB:
        return IntTerm(value=gib_to_bytes(number), line=line, printed=printed)
    if unit is Unit.COUNT:
        return IntTerm(value=int(number), line=line, printed=printed)
    return FloatTerm(value=number, line=line, printed=printed)


def _printed(raw: str, unit: Unit, match: re.Match[str], group: str) -> str:
    """The number with the unit text that follows it in the line (GB, GiB, x, tokens)."""
    tail = match.string[match.end(group):match.end(group) + 4]
    suffix = re.match(r" ?(?:GiB|GB|x)", tail)
    return raw + (suffix.group(0) if suffix else "")


def _candidate_lines(text: str) -> tuple[list[tuple[int, str]], int, int]:
    """(line number, line) for each line holding an anchor, the number of lines, and the number
    of long lines skipped. Each anchor is found with str.find (C speed) and the scan jumps to the
    end of each hit's line, so every character is visited a bounded number of times per anchor."""
    spans: dict[int, int] = {}  # line start -> line end
    for anchor in ANCHORS:
        pos = 0
        while (i := text.find(anchor, pos)) >= 0:
            start = text.rfind("\n", 0, i) + 1
            end = text.find("\n", i)
            end = len(text) if end < 0 else end
            spans[start] = end
            if len(spans) > MAX_CANDIDATE_LINES:
                raise _LimitError(MAX_CANDIDATE_LINES)
            pos = end + 1
    out: list[tuple[int, str]] = []
    skipped = 0
    lineno, counted_to = 1, 0
    for start in sorted(spans):
        lineno += text.count("\n", counted_to, start)
        counted_to = start
        end = spans[start]
        if end - start > MAX_LINE_CHARS:
            skipped += 1
        else:
            out.append((lineno, text[start:end]))
    num_lines = text.count("\n") + (1 if text and not text.endswith("\n") else 0)
    return out, num_lines, skipped


class _LimitError(Exception):
    pass


def _is_comment(line: str) -> bool:
    """A '#' line is a note (a shell transcript, an annotation), except vLLM's own '# GPU blocks'."""
    head = line.lstrip()
    return head.startswith("#") and not head.startswith(VLLM_HASH_LINES)


def _decode(data: bytes, source: str) -> str:
    if NUL in data:
        raise InputFileError(f"holds NUL bytes (first at byte {data.index(NUL)}): a binary file, not an engine log",
                             source=source, hint="pass the engine's start-up log as text")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputFileError(f"is not UTF-8 text (byte {e.start}): a binary file, not an engine log", source=source,
                             hint="pass the engine's start-up log as text") from None
    return _ANSI.sub("", text) if "\x1b" in text else text


def parse_engine_log(text: str, source: str) -> EngineLog:
    """The memory figures in a vLLM, SGLang or TGI start-up log. Raises InputFileError naming
    `source` when no engine line is found or the log ends before the KV cache is sized."""
    if "\x1b" in text:
        text = _ANSI.sub("", text)
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")  # progress bars redraw with CR
    try:
        lines, num_lines, skipped = _candidate_lines(text)
    except _LimitError:
        raise InputFileError(f"more than {MAX_CANDIDATE_LINES} lines name engine memory keywords: "
                             "not one engine's start-up log", source=source,
                             hint="pass the start-up part of the log (up to the KV cache lines)") from None
    found: dict[Engine, dict[str, IntTerm | FloatTerm]] = {"vllm": {}, "sglang": {}, "tgi": {}}
    generations: dict[Engine, set[Generation]] = {"vllm": set(), "sglang": set(), "tgi": set()}
    first_line: dict[Engine, int] = {}
    version: str | None = None
    for lineno, line in lines:
        if _is_comment(line):
            continue
        if version is None and (v := _VERSION_LINE.search(line)) is not None:
            version = v.group(1)
        for p in _ALL:
            if p.keyword not in line or (m := p.regex.search(line)) is None:
                continue
            first_line.setdefault(p.engine, lineno)
            if p.generation:
                generations[p.engine].add(p.generation)
            for field, unit in p.fields:
                raw = m.group(field)
                term = _term(raw, unit, lineno, _printed(raw, unit, m, field))
                seen = found[p.engine].get(field)
                # Ranks print their own capacity; the engine allocates the smallest. Else the first.
                if seen is None or (field in PER_RANK_MIN_FIELDS and term.value < seen.value):
                    found[p.engine][field] = term
    engines = [e for e in found if found[e]]
    if not engines:
        raise InputFileError(
            "no vLLM/SGLang/TGI start-up memory lines found: expected 'GPU KV cache size', '# GPU blocks', "
            "'Memory profiling results', 'model weights take', 'KV Cache is allocated', 'max_total_num_tokens=' "
            "or 'Setting max batch total tokens to'" + (f" ({skipped} lines over {MAX_LINE_CHARS} characters skipped)"
                                                        if skipped else ""),
            source=source, hint="pass the engine's own start-up log (stdout/stderr of vllm serve, "
                                "sglang.launch_server or text-generation-launcher)")
    # The engine with the most figures; a tie goes to the one whose lines come first.
    engine = max(engines, key=lambda e: (len(found[e]), -first_line[e]))
    terms = found[engine]
    if not any(f in terms for f in CAPACITY_FIELDS[engine]):
        have = ", ".join(f"{name} (line {t.line})" for name, t in sorted(terms.items(), key=lambda kv: kv[1].line))
        raise InputFileError(
            f"{ENGINE_NAMES[engine]} log ends before the KV cache is sized (truncated?): found {have}; "
            f"missing {CAPACITY_LINES[engine]}", source=source,
            hint="pass the whole start-up log, up to the KV cache lines")
    if "k_cache_bytes" in terms and "v_cache_bytes" in terms and "kv_cache_bytes" not in terms:
        k, v = terms["k_cache_bytes"], terms["v_cache_bytes"]
        terms = {**terms, "kv_cache_bytes": IntTerm(value=k.value + v.value, line=k.line,
                                                    printed=f"K {k.printed} + V {v.printed}")}
    generation: Generation
    if engine == "vllm":
        generation = next((g for g in GENERATION_ORDER if g in generations["vllm"]), "vllm")
    else:
        generation = engine
    return EngineLog(source=source, engine=engine, generation=generation, num_lines=num_lines,
                     num_long_lines_skipped=skipped, engine_version=version if engine == "vllm" else None, **terms)


def read_engine_log(path: Path, label: str | None = None) -> EngineLog:
    """Read (at most MAX_LOG_BYTES of) a log file and parse it."""
    source = label or str(path)
    data = fileio.read_regular_file_bytes(path, max_bytes=MAX_LOG_BYTES, label=source, what="an engine log",
                                          hint="pass the start-up part of the log (its first lines up to the KV cache lines)")
    return parse_engine_log(_decode(data, source), source)


__all__ = ["EngineLog", "IntTerm", "FloatTerm", "LinePattern", "PATTERNS", "parse_engine_log", "read_engine_log",
           "MAX_LOG_BYTES", "MAX_LINE_CHARS", "MAX_CANDIDATE_LINES"]
