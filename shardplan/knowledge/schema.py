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

_VERSION = re.compile(r"^v?(\d+)\.(\d+)(?:\.(\d+))?")


def parse_version(text: str) -> tuple[int, int, int]:
    """'0.6.4.post1' -> (0, 6, 4); 'v0.8' -> (0, 8, 0). Raises ValueError on anything else."""
    m = _VERSION.match(text.strip())
    if m is None:
        raise ValueError(f"not a version: {text!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class DeviceDefault(Frozen):
    """One row of a by-device default; the first row a device matches wins."""

    min_memory_gib: float = Field(0.0, ge=0, description="applies to devices with at least this much memory, GiB")
    exclude_names: tuple[str, ...] = Field((), description="device-name substrings this row excludes (case-insensitive)")
    value: int = Field(ge=1, description="the default (tokens or sequences)")

    def matches(self, memory_gib: float, device_name: str) -> bool:
        name = device_name.lower()
        return memory_gib >= self.min_memory_gib and not any(x.lower() in name for x in self.exclude_names)


class TpDefault(Frozen):
    """One row of a by-tensor-parallel-size default; the first row with min_tp <= tp wins."""

    min_tp: int = Field(ge=1, description="applies from this tensor-parallel size up")
    value: float = Field(gt=0, le=1, description="the default")


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
    refusal: Literal["tokens", "bytes", "no_room"] = Field(
        description="tokens: refuses when max_model_len exceeds the cache's tokens (V0 worker); bytes: when one "
                    "max_model_len sequence's KV bytes exceed the KV memory (V1 check_enough_kv_cache_memory); "
                    "no_room: only when nothing is left for the KV pool (longer requests are refused one by one)")
    accounting: Literal["profiled", "static_fraction"] = Field(
        "profiled", description="profiled: budget = device x utilization, minus weights, the profiling pass's peak "
                                "and non-torch memory (vLLM); static_fraction: a pool of (free memory at start) x "
                                "fraction holds weights and KV, activations live outside it (SGLang)")
    static_fraction_by_tp: list[TpDefault] | None = Field(
        None, description="static_fraction: the default fraction by tensor-parallel size, largest min_tp first")
    sources: dict[str, str] = Field(description="field -> where the rule comes from (file at a tag, PR, release note)")

    @model_validator(mode="after")
    def _check(self) -> "EngineEra":
        parse_version(self.min_version)
        if self.max_version is not None and parse_version(self.max_version) <= parse_version(self.min_version):
            raise ValueError(f"max_version {self.max_version} is not after min_version {self.min_version}")
        if self.chunked_prefill == "above_context" and self.chunked_prefill_above_tokens is None:
            raise ValueError("chunked_prefill: above_context needs chunked_prefill_above_tokens")
        documented = {"generation", "gpu_memory_utilization", "block_size", "max_num_seqs", "chunked_prefill",
                      "chunked_budget_tokens", "unchunked_min_tokens", "cuda_context_in_budget",
                      "cuda_graphs_in_budget", "refusal"}
        if self.accounting == "static_fraction":
            if not self.static_fraction_by_tp or min(r.min_tp for r in self.static_fraction_by_tp) != 1:
                raise ValueError("accounting: static_fraction needs static_fraction_by_tp with a min_tp: 1 row")
            documented |= {"accounting", "static_fraction_by_tp"}
        missing = sorted(documented - set(self.sources))
        if missing:
            raise ValueError(f"no source for {', '.join(missing)}")
        return self

    def holds_for(self, version: tuple[int, int, int]) -> bool:
        lo = parse_version(self.min_version)
        hi = parse_version(self.max_version) if self.max_version else None
        return lo <= version and (hi is None or version < hi)


class EngineFile(Frozen):
    """`knowledge/engines/<engine>.yaml`."""

    engine: str = Field(description="the name users pass to --engine")
    display_name: str = Field(description="how output names it")
    versions: list[str] = Field(min_length=1, description="released versions shardplan knows, oldest first")
    eras: list[EngineEra] = Field(min_length=1, description="rules by version range, oldest first")

    @model_validator(mode="after")
    def _cover(self) -> "EngineFile":
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

    @property
    def label(self) -> str:
        return f"{self.display_name} {self.version}"

    def by_device(self, table: list[DeviceDefault], memory_gib: float, device_name: str) -> int:
        for row in table:
            if row.matches(memory_gib, device_name):
                return row.value
        return table[-1].value


__all__ = ["DeviceDefault", "EngineEra", "EngineFile", "EngineRules", "TpDefault", "parse_version"]
