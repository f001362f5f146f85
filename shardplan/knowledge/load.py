"""Reads the engine files (`knowledge/engines/*.yaml`, bundled with the package) and resolves
an engine and version into `EngineRules`. The I/O edge of `knowledge`: files are read through
`specs.loading.read_structured` (bounded, safe YAML) and validated by `knowledge.schema`."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from pydantic import ValidationError

from shardplan.errors import ShardplanError, UnknownNameError
from shardplan.knowledge.schema import BandsFile, EngineFile, EngineRules, MetricsFile, StackFile, parse_version
from shardplan.knowledge.targets import TargetsFile
from shardplan.specs.loading import read_structured, validation_error

ENGINES_DIR = Path(__file__).resolve().parent / "engines"
STACKS_DIR = Path(__file__).resolve().parent / "stacks"
BANDS_PATH = Path(__file__).resolve().parent / "bands.yaml"
METRICS_PATH = Path(__file__).resolve().parent / "metrics.yaml"
TARGETS_PATH = Path(__file__).resolve().parent / "targets.yaml"
DEFAULT_ENGINE = "vllm"
DEFAULT_STACK = "torchtitan"


def known_engines() -> list[str]:
    return sorted(p.stem for p in ENGINES_DIR.glob("*.yaml"))


@lru_cache(maxsize=None)
def engine_file(engine: str) -> EngineFile:
    """The bundled file of one engine (a name from `known_engines()`, any case)."""
    name = engine.lower()
    if name not in known_engines():
        raise UnknownNameError(f"unknown engine '{engine}'", field="--engine",
                               hint=f"use one of {', '.join(known_engines())}")
    path = ENGINES_DIR / f"{name}.yaml"
    try:
        return EngineFile.model_validate(read_structured(path))
    except ValidationError as e:
        raise validation_error(e, str(path)) from None


def engine_rules(engine: str = DEFAULT_ENGINE, version: str | None = None) -> EngineRules:
    """The rules of `engine` at `version` (default: the newest version shardplan knows). A
    version outside the known range, or between eras, is an error naming the versions known."""
    f = engine_file(engine)
    chosen = version or f.newest
    known = f"{f.display_name} versions known: {f.versions[0]} to {f.newest} ({', '.join(f.versions)})"
    try:
        v = parse_version(chosen)
    except ValueError:
        raise ShardplanError(f"'{chosen}' is not a version", field="--engine-version",
                             hint=f"give X.Y or X.Y.Z; {known}") from None
    if not parse_version(f.versions[0]) <= v <= parse_version(f.newest):
        raise ShardplanError(f"{f.display_name} {chosen} is not a version shardplan knows", field="--engine-version",
                             hint=known)
    era = next((e for e in f.eras if e.holds_for(v)), None)
    if era is None:
        raise ShardplanError(f"no rules for {f.display_name} {chosen}", field="--engine-version", hint=known)
    multimodal = next((m for m in f.multimodal_eras if m.holds_for(v)), None)
    offload = next((o for o in f.offload_eras if o.holds_for(v)), None)
    return EngineRules(engine=f.engine, display_name=f.display_name, version=chosen, era=era,
                       fraction_name=f.fraction_name, multimodal=multimodal, offload=offload,
                       weight_formats=tuple(f.weight_formats), kv_block_formats=tuple(f.kv_block_formats),
                       checkpoint_formats=tuple(c for c in f.checkpoint_formats if parse_version(c.min_version) <= v),
                       kv_block_formats_source=f.kv_block_formats_source, kv_heads_copied=f.kv_heads_copied,
                       speculative_with_pp=f.speculative_with_pp,
                       fp8_marlin_architectures=tuple(f.fp8_marlin.architectures) if f.fp8_marlin is not None
                       and parse_version(f.fp8_marlin.min_version) <= v else (),
                       overlap_switch=f.overlap_switch if f.overlap_switch is not None
                       and parse_version(f.overlap_switch.min_version) <= v else None)


def known_stacks() -> list[str]:
    return sorted(p.stem for p in STACKS_DIR.glob("*.yaml"))


@lru_cache(maxsize=None)
def stack_rules(stack: str = DEFAULT_STACK) -> StackFile:
    """The bundled file of one training stack (a name from `known_stacks()`, any case)."""
    name = stack.lower()
    if name not in known_stacks():
        raise UnknownNameError(f"unknown stack '{stack}'", field="--stack", hint=f"use one of {', '.join(known_stacks())}")
    path = STACKS_DIR / f"{name}.yaml"
    try:
        return StackFile.model_validate(read_structured(path))
    except ValidationError as e:
        raise validation_error(e, str(path)) from None


def engine_generation(engine: str, version: str | None) -> str | None:
    """The engine generation ('vLLM V1') whose measured cases band a prediction at `version`;
    None when no version is given (the fields as given: no rules, so no generation)."""
    if version is None:
        return None
    return engine_rules(engine, version).era.generation


@lru_cache(maxsize=None)
def bands_file(path: Path = BANDS_PATH) -> BandsFile:
    """The measured error bands (`knowledge/bands.yaml`, written by
    `python -m shardplan.validation.bands`)."""
    try:
        return BandsFile.model_validate(read_structured(path))
    except ValidationError as e:
        raise validation_error(e, str(path)) from None


@lru_cache(maxsize=None)
def metrics_file(path: Path = METRICS_PATH) -> MetricsFile:
    """The Prometheus series names `shardplan watch` reads, by exporter and version
    (`knowledge/metrics.yaml`)."""
    try:
        return MetricsFile.model_validate(read_structured(path))
    except ValidationError as e:
        raise validation_error(e, str(path)) from None


def targets_file() -> TargetsFile:
    """What each deployment target runs (`knowledge/targets.yaml`, at TARGETS_PATH): the rules the
    search, the exporters and verify's up-front checks all read."""
    return _targets_file(TARGETS_PATH)


@lru_cache(maxsize=None)
def _targets_file(path: Path) -> TargetsFile:
    try:
        return TargetsFile.model_validate(read_structured(path))
    except ValidationError as e:
        raise validation_error(e, str(path)) from None


def known_targets() -> list[str]:
    return list(targets_file().targets)


__all__ = ["BANDS_PATH", "DEFAULT_ENGINE", "DEFAULT_STACK", "METRICS_PATH", "bands_file", "engine_file",
           "engine_generation", "engine_rules", "known_engines", "known_stacks", "known_targets", "metrics_file", "stack_rules", "targets_file"]
