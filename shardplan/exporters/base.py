"""What every exporter shares: the files it returns, the plan facts engines take as flags, shell
command rendering checked against a pinned flag list, and the error for a plan a target cannot
express. Pure: exporters return text; the CLI writes it (`fileio.write_text_atomic`)."""

from __future__ import annotations

import json
import math
import re
import shlex
import warnings
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Sequence

import yaml

from shardplan.errors import EXIT_DOES_NOT_FIT, ShardplanError
from shardplan.knowledge.schema import parse_version
from shardplan.plan.schema import DeploymentManifest, InferenceWorkloadSection, TrainingWorkloadSection
from shardplan.specs.model import ModelSpec

FLAGS_DIR = Path(__file__).parent / "flags"
GIB = 1024**3


@dataclass(frozen=True)
class ExportFile:
    name: str  # file name inside the output folder
    text: str
    executable: bool = False  # a shell script


@dataclass(frozen=True)
class ExportOptions:
    """What a plan does not say but a launch needs. None: the exporter's documented default."""

    model_path: str | None = None  # checkpoint path or HF id; default: the manifest's hf_id
    script: str | None = None  # training: the script (and its arguments) each rank runs
    plan_file: str = "plan.yaml"  # how scripts refer to the manifest (for `shardplan verify`)
    image: str | None = None  # container image (kubernetes)
    port: int | None = None  # serving port / rendezvous port
    nvme_path: str = "/local_nvme"  # where NVMe offload writes (a placeholder to edit)
    engine: str = "vllm"  # kubernetes: which serving engine the pods run
    cache_pvc: str | None = None  # kubernetes: PersistentVolumeClaim for the model cache; None: an emptyDir
    hf_token_secret: str = "hf-token"  # kubernetes: Secret whose key `token` becomes HF_TOKEN (optional)
    max_restarts: int = 3  # torchrun/slurm/kubernetes training: times torchrun restarts the ranks after a failure
    elastic_min_nodes: int | None = None  # torchrun --nnodes MIN:MAX: fewest nodes to run on; None: all the plan's
    disaggregated: bool = False  # serving: launch the manifest's prefill and decode pools (vllm)
    engine_version: str | None = None  # serving: the engine version whose flag list to use; None: the plan's (see engine_flags)


@dataclass(frozen=True)
class ExportContext:
    manifest: DeploymentManifest
    spec: ModelSpec | None  # the plan's model spec when its source could be read back
    options: ExportOptions


class CannotExpress(ShardplanError):
    """The target has no way to run what the plan says (exit 2: pick another target or plan)."""


class PlanDoesNotFit(ShardplanError):
    """The plan does not fit its GPUs: what a target launches from it would fail (exit 3)."""

    exit_code = EXIT_DOES_NOT_FIT


# Serving targets whose exporters take a plan whose only shortfall is a KV cache short of one sequence
# and decide themselves (`refuse_unfit`): vLLM, SGLang, TGI, TensorRT-LLM (and Kubernetes pods running
# them) start with a larger memory share (`share_holding_one_sequence`), llama.cpp refuses with its own
# reason (`llamacpp.slots`), transformers (accelerate) grows its cache as it generates. torchrun, slurm
# and jax start no engine that could resize anything: they refuse such a plan like any other.
KV_SHORTFALL_TARGETS = frozenset({"vllm", "sglang", "tgi", "trtllm", "kubernetes", "llamacpp", "accelerate"})


def cannot(target: str, field: str, what: str, hint: str) -> CannotExpress:
    return CannotExpress(f"{target} cannot express this plan: {what}", field=field, hint=hint)


# ----- plan facts -------------------------------------------------------------------------


def serving(ctx: ExportContext, target: str) -> InferenceWorkloadSection:
    """The serving workload; a training plan is refused (a plan that does not fit was, by `export`)."""
    m = ctx.manifest
    if not isinstance(m.workload, InferenceWorkloadSection):
        raise cannot(target, "workload.kind", f"{target} serves models and this is a training plan "
                     f"(zero_stage={m.layout.zero_stage})", "export it --to deepspeed, torchrun, slurm, accelerate or kubernetes")
    return m.workload


def training(ctx: ExportContext, target: str) -> TrainingWorkloadSection:
    m = ctx.manifest
    if not isinstance(m.workload, TrainingWorkloadSection):
        raise cannot(target, "workload.kind", f"{target} launches training and this is a serving plan",
                     "export it --to vllm, sglang, tgi, trtllm or kubernetes")
    return m.workload


def refuse_unfit(m: DeploymentManifest, target: str) -> None:
    """Refuse a plan that does not fit (PlanDoesNotFit, exit 3), whatever the target: `export` calls
    this once, before any exporter runs. One exception: a serving plan whose only shortfall is a KV
    cache smaller than one max_model_len sequence, exported to a serving target (KV_SHORTFALL_TARGETS):
    engines take a larger memory share for that (vLLM's own advice), which `share_holding_one_sequence`
    works out. (A KV cache that is there but short is the serving model's only failure with every
    stage's weights in budget.)"""
    if m.predicted.fits:
        return
    kv = m.predicted.kv_cache
    if target in KV_SHORTFALL_TARGETS and kv is not None and 0 < kv.capacity_tokens < kv.max_model_len_tokens:
        return
    reason = (m.predicted.reason or "").strip()
    raise PlanDoesNotFit(f"the plan does not fit{f' ({reason})' if reason else ''}: what {target} launches from it "
                         "would run out of memory", field="predicted.fits",
                         hint="re-run shardplan recommend and export its plan")


def model_ref(ctx: ExportContext) -> str:
    """The checkpoint an engine loads: --model-path, else the HF id, else a placeholder path.
    Engines take it as a word of their command line, so it must not read as a flag
    (an hf_id of `--trust-remote-code` in someone else's plan would switch it on)."""
    m = ctx.manifest
    if ctx.options.model_path is not None:
        return checked_word(ctx.options.model_path, "--model-path", "a checkpoint folder or a Hugging Face id")
    if m.model.hf_id is not None:
        return checked_word(m.model.hf_id, "model.hf_id", "a Hugging Face id such as meta-llama/Llama-3.1-8B")
    return f"/models/{safe_name(m.model.name, 'model')}"


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")  # line breaks to bash, Python and YAML among them


def checked_word(value: str, field: str, what: str) -> str:
    """A value placed as one word of a command: not empty, not starting with '-', no control
    characters (a line break would end the command). Quoting keeps it one word; this keeps it
    from being read as an option."""
    if not value.strip() or value.startswith("-") or _CONTROL.search(value):
        raise ShardplanError(f"{value!r} cannot be placed in a command line", field=field,
                             hint=f"give {what} that does not start with '-' and has no control characters")
    return value


def safe_name(text: str, default: str) -> str:
    """Letters, digits, '.', '_' and '-' only (job names, placeholder paths); runs of anything
    else become '-'."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-.") or default


def comment(text: str) -> str:
    """Text safe inside a `#` comment of a shell script, YAML file or Python module: control
    characters (line breaks above all, which would end the comment) become spaces."""
    return _CONTROL.sub(" ", text)


def script_words(ctx: ExportContext, default: str) -> list[str]:
    """--script split as a shell would split it; its first word is the program, never an option
    of the launcher it follows."""
    text = ctx.options.script if ctx.options.script is not None else default
    try:
        words = shlex.split(text)
    except ValueError as e:
        raise ShardplanError(f"cannot split {text!r} into words: {e}", field="--script",
                             hint="balance the quotes, e.g. --script \"train.py --name 'my run'\"") from None
    if not words:
        raise ShardplanError("is empty", field="--script", hint="give the script and its arguments, e.g. train.py --lr 3e-4")
    checked_word(words[0], "--script", "a script or program first, then its arguments")
    for w in words:
        if _CONTROL.search(w):
            raise ShardplanError(f"{w!r} has a control character", field="--script", hint="remove it")
    return words


def gpus_per_node_used(m: DeploymentManifest) -> int:
    hw = m.hardware
    return hw.gpus_per_node if hw.num_nodes > 1 else min(hw.num_gpus, hw.gpus_per_node)


def replica_gpus(m: DeploymentManifest) -> int:
    """GPUs of one serving replica (or one training model copy): tp x pp x cp."""
    return m.layout.tp * m.layout.pp * m.layout.cp


def engine_replicas(m: DeploymentManifest, target: str) -> int:
    """Serving replicas that run as ONE engine process group: 1, unless expert parallelism spans
    replicas. A serving plan's expert group of ep x etp ranks folds over its dp x tp ranks; when
    it is wider than a replica's tp ranks it spans (ep x etp) / tp replicas, whose experts are
    split among them, so they must run as one engine (vLLM --data-parallel-size with
    --enable-expert-parallel, SGLang DP attention), never as independent servers that would each
    need every expert. A group that is not a whole number of replicas is refused."""
    L = m.layout
    if not isinstance(m.workload, InferenceWorkloadSection) or L.ep * L.etp <= L.tp:
        return 1
    if (L.ep * L.etp) % L.tp:  # the declared rule (knowledge/targets.yaml `engine_groups`) says why
        from shardplan.exporters.targets import check_rule_set

        check_rule_set(ExportContext(manifest=m, spec=None, options=ExportOptions()), "engine_groups", target)
    return L.ep * L.etp // L.tp


def engine_gpus(m: DeploymentManifest, target: str) -> int:
    """GPUs of one engine process group: replica_gpus, times engine_replicas."""
    return replica_gpus(m) * engine_replicas(m, target)


def num_engines(m: DeploymentManifest, target: str) -> int:
    """Engine process groups the plan runs: dp / engine_replicas (a whole number: ep x etp divides dp x tp)."""
    return m.layout.dp // engine_replicas(m, target)


def nodes_per_replica(m: DeploymentManifest, target: str = "export") -> int:
    """Nodes one engine process group spans (a replica's, or a dp x ep group's)."""
    return max(1, math.ceil(engine_gpus(m, target) / gpus_per_node_used(m)))


def torch_dtype(dtype: str) -> str:
    """Our dtype names as engines spell them."""
    return {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(dtype, dtype)


def kv_tokens_at(m: DeploymentManifest, kv_budget_bytes: float) -> int:
    """Tokens a KV cache of that many bytes per GPU holds on the binding rank, in whole blocks."""
    kv = m.predicted.kv_cache
    assert kv is not None
    block_bytes = kv.bytes_per_token_per_gpu * kv.block_size_tokens
    return int(max(0.0, kv_budget_bytes) // block_bytes) * kv.block_size_tokens if block_bytes > 0 else 0


def non_kv_bytes(m: DeploymentManifest) -> float:
    """Predicted bytes per GPU besides the KV cache (weights, activations, overhead, ...)."""
    b = m.predicted.memory.per_gpu_bytes
    return b["total"] - b.get("kv_cache", 0.0)


MAX_MEMORY_FRACTION = 0.95  # the most an export asks for: CUDA context, NCCL and fragmentation need the rest


def share_holding_one_sequence(ctx: ExportContext, *, planned: float, static_bytes: float, of_bytes: float,
                               target: str, flag: str) -> float:
    """An engine's memory share (of `of_bytes` per GPU): `planned`, when `planned x of_bytes`
    minus `static_bytes` leaves a KV cache that holds one max_model_len sequence on the binding
    rank (engines refuse to start otherwise); else the least share, to 0.01, that does, refused
    above MAX_MEMORY_FRACTION (exit 3). vLLM/TGI: a share of capacity over everything; SGLang:
    of capacity over weights + KV; TensorRT-LLM: of the memory left after weights and buffers."""
    m = ctx.manifest
    serving(ctx, target)
    kv = m.predicted.kv_cache
    assert kv is not None
    tokens = kv.max_model_len_tokens
    if kv_tokens_at(m, planned * of_bytes - static_bytes) >= tokens:
        return planned
    need_bytes = static_bytes + math.ceil(tokens / kv.block_size_tokens) * kv.block_size_tokens * kv.bytes_per_token_per_gpu
    frac = math.ceil(need_bytes / of_bytes * 100 - 1e-9) / 100
    if frac > MAX_MEMORY_FRACTION:
        raise PlanDoesNotFit(f"{target} would need {flag} {frac:.2f} to hold one {tokens}-token sequence "
                             f"(more than {MAX_MEMORY_FRACTION})", field="workload.max_model_len",
                             hint="re-plan with a shorter --max-model-len or more GPUs")
    return frac


def memory_utilization(ctx: ExportContext, target: str, flag: str) -> float:
    """A cap on everything an engine allocates (vLLM's --gpu-memory-utilization, TGI's
    --cuda-memory-fraction): the plan's, raised when its KV cache is short of one sequence."""
    m = ctx.manifest
    return share_holding_one_sequence(ctx, planned=serving(ctx, target).gpu_memory_utilization,
                                      static_bytes=non_kv_bytes(m), of_bytes=m.hardware.memory_capacity_bytes,
                                      target=target, flag=flag)


# ----- shell commands checked against a pinned flag list ----------------------------------


class Raw(str):
    """A shell expression (e.g. "$HEAD_IP:29500") written without quoting, for the shell to expand."""


class Words(tuple):
    """The values of a flag that takes several (argparse nargs='+'/'*'), written as separate words,
    each checked against the flag's choices."""


@dataclass(frozen=True)
class FlagTable:
    tool: str
    command: str
    version: str
    sources: tuple[str, ...]
    flags: dict[str, dict[str, Any]]
    prefix: str = "--"
    extra: dict[str, Any] | None = None

    def check(self, name: str, value: str | None) -> None:
        """An exporter bug if a flag is not in the pinned version's list or a value not among its choices;
        a flag the list marks deprecated (the engine's own parser says so) is reported as a DeprecatedFlag
        warning: the engine still takes it, but the export should move to what replaces it."""
        spec = self.flags.get(name)
        if spec is None:
            raise AssertionError(f"{self.command} {self.version} has no flag {self.prefix}{name}")
        if spec.get("deprecated"):
            warnings.warn(DeprecatedFlag(f"{self.command} {self.version} marks {self.prefix}{name} deprecated"
                                         + (f": {spec['note']}" if spec.get("note") else "")), stacklevel=3)
        takes = spec.get("takes_value", True)
        if takes != (value is not None) and not spec.get("optional_value"):
            raise AssertionError(f"{self.prefix}{name} {'takes' if takes else 'takes no'} value in {self.command}")
        if value is not None and not isinstance(value, Raw) and not self.allows(name, value):
            source = spec.get("choices_source")
            raise AssertionError(f"{self.prefix}{name} {value!r} is not one of {spec['choices']} in {self.command} "
                                 f"{self.version}" + (f" ({source})" if source else ""))

    def allows(self, name: str, value: str) -> bool:
        """Whether the list's `choices` for flag `name` take `value` (true when it lists none). Choices with a
        `choices_source` are those the engine checks after parsing, read from that file and symbol of the
        release's source (tools/dump_engine_flags.py AFTER_PARSING): the engine refuses other values
        all the same, only later than argparse would."""
        choices = self.flags.get(name, {}).get("choices")
        return choices is None or value in [str(c) for c in choices]

    @property
    def pinned(self) -> str:
        return f"{self.tool} {self.version}"


class DeprecatedFlag(UserWarning):
    """An export emits a flag that its pinned flag list marks deprecated."""


# The engine version each exporter's flags are checked against by default (and its image is tagged
# with): the newest release whose flag list the exports validate against. Older lists stay bundled as
# `<list>-<version>.yaml` (flag_table("vllm-0.11.0")); `engine_flags` picks one by the plan's version.
PINNED_VERSIONS = {"vllm": "0.33.0", "sglang": "0.5.23", "tgi": "3.3.7"}
# engine (as plans and `export --to` name it) -> the stem of its serving command's flag lists
FLAG_LISTS = {"vllm": "vllm", "sglang": "sglang", "tgi": "tgi"}
DISPLAY_NAMES = {"vllm": "vLLM", "sglang": "SGLang", "tgi": "TGI", "trtllm": "TensorRT-LLM"}


@lru_cache(maxsize=None)
def flag_table(name: str) -> FlagTable:
    """A flag list kept in `exporters/flags/<name>.yaml`, with the version and source it came from;
    an engine's bare name ("vllm") means its pinned version's list (PINNED_VERSIONS)."""
    if name in PINNED_VERSIONS:
        name = f"{name}-{PINNED_VERSIONS[name]}"
    data = yaml.safe_load((FLAGS_DIR / f"{name}.yaml").read_text())
    known = {"tool", "command", "version", "sources", "flags", "prefix"}
    return FlagTable(tool=data["tool"], command=data["command"], version=str(data["version"]),
                     sources=tuple(data["sources"]), flags=data["flags"], prefix=data.get("prefix", "--"),
                     extra={k: v for k, v in data.items() if k not in known} or None)


def bundled_versions(stem: str) -> list[str]:
    """The versions of the bundled `flags/<stem>-<version>.yaml` lists, oldest first."""
    found = []
    for path in FLAGS_DIR.glob(f"{stem}-*.yaml"):
        text = path.stem[len(stem) + 1:]
        try:
            found.append((parse_version(text), text))
        except ValueError:  # another list sharing the stem (trtllm-serve-* under trtllm)
            continue
    return [v for _, v in sorted(found)]


@dataclass(frozen=True)
class ChosenFlags:
    """The flag list an export is checked against, and why that one."""

    table: FlagTable
    why: str  # e.g. "the plan's --engine-version 0.11.0"
    notes: tuple[str, ...] = ()  # header lines about the choice (memory rules of another version)


def choose_version(versions: Sequence[str], pinned: str, wanted: str | None, *, asked_by: str) -> tuple[str, str]:
    """(bundled version, why) for an engine version `wanted` (None: none named).

    Rule: the newest bundled list not newer than `wanted`, comparing (major, minor, patch) as numbers
    (0.5.3 < 0.5.23), never a list newer than the pin. vLLM and SGLang are 0.x releases in which any
    minor (and SGLang any patch) release adds and removes flags, so no "same major line" can be
    trusted to share flags; a list not newer than the engine holds no flag the engine has not yet
    got, and what the release removed since that list is the remaining risk, which the why states.
    A version newer than the pin gets the pin, one older than every bundled list the oldest; both
    say so."""
    if wanted is None:
        return pinned, f"the pinned version: {asked_by}"
    try:
        key = parse_version(wanted)
    except ValueError:
        raise ShardplanError(f"{wanted!r} is not a version", field="--engine-version",
                             hint="give X.Y or X.Y.Z, e.g. 0.11.0") from None
    usable = [v for v in versions if parse_version(v) <= parse_version(pinned)] or [pinned]
    if key > parse_version(pinned):
        return pinned, f"the pinned and newest bundled list: {asked_by} {wanted} is newer"
    older = [v for v in usable if parse_version(v) <= key]
    if not older:
        return usable[0], f"the oldest bundled list: {asked_by} {wanted} is older than every bundled list"
    best = older[-1]
    if parse_version(best) == key:
        return best, f"{asked_by} {wanted}"
    return best, (f"the newest bundled list not newer than {asked_by} {wanted}; flags removed after "
                  f"{best} would make the engine refuse the command")


def _newest_rules(engine: str) -> str | None:
    """The newest version of `engine` whose memory rules shardplan knows (what plans default to)."""
    from shardplan.knowledge.load import engine_file

    try:
        return engine_file(engine).newest
    except ShardplanError:
        return None


def overlap_args(ctx: ExportContext, engine: str) -> list[Arg]:
    """The flag that makes `engine` form its batches as the plan was costed (workload.batches_in_flight,
    cost/serving_load.py) where that differs from its version's default: vLLM's --async-scheduling
    or --no-async-scheduling, SGLang's --disable-overlap-schedule (knowledge/engines/*.yaml
    overlap_switch). None for a plan made for another engine or no version."""
    from shardplan.cost.serving_load import batches_in_flight_at
    from shardplan.knowledge.load import engine_rules

    m = ctx.manifest
    wl = m.workload
    if not isinstance(wl, InferenceWorkloadSection) or wl.engine != engine or wl.engine_version is None \
            or wl.batches_in_flight is None:  # a plan written before it was recorded: the version's default
        return []
    try:  # the release the export is for: `export --engine-version`, else the plan's
        rules = engine_rules(engine, ctx.options.engine_version or wl.engine_version)
    except ShardplanError:  # a version shardplan has no rules for (a plan edited by hand): its default is unknown
        return []
    planned = batches_in_flight_at(wl.batches_in_flight, wl.batches_in_flight_pp1_only, m.layout.pp)
    default = batches_in_flight_at(rules.era.batches_in_flight, rules.era.batches_in_flight_pp1_only, m.layout.pp)
    switch = rules.overlap_switch
    if planned == default or switch is None:
        return []
    flag = switch.on_flag if planned > 1 else switch.off_flag
    return [(flag, None)] if flag else []


def engine_flags(ctx: ExportContext, engine: str) -> ChosenFlags:
    """The flag list of `engine`'s serving command for this export: `export --engine-version` when
    given, else the plan's `workload.engine_version` when the plan was made for this engine with an
    older version than the newest rules shardplan knows (the default), else the pin (choose_version
    has the rule). A plan sized with another version's memory rules than the
    flags says so."""
    stem = FLAG_LISTS[engine]
    wl = ctx.manifest.workload
    planned = wl.engine_version if isinstance(wl, InferenceWorkloadSection) and wl.engine == engine else None
    newest_rules = _newest_rules(engine)
    if ctx.options.engine_version is not None:
        wanted, asked_by = ctx.options.engine_version, "export --engine-version"
    elif planned is not None and planned == newest_rules != PINNED_VERSIONS[engine]:
        # The newest memory rules shardplan knows hold, as far as it knows, for the releases after
        # them: such a plan (every plan without --engine-version) runs on the pinned current release.
        # (Rules as new as the pin are the plan's own version.)
        wanted, asked_by = None, f"the plan uses the newest {engine} rules shardplan knows ({planned})"
    elif planned is not None:
        wanted, asked_by = planned, "the plan's --engine-version"
    else:
        wanted = None
        asked_by = (f"the plan names {wl.engine} {wl.engine_version}, not a {engine} version"
                    if isinstance(wl, InferenceWorkloadSection) and wl.engine_version is not None
                    else "the plan names no engine version")
    version, why = choose_version(bundled_versions(stem), PINNED_VERSIONS[engine], wanted, asked_by=asked_by)
    notes = ()
    if planned is not None and ctx.options.engine_version is not None and version != planned:
        notes = (f"note: memory sized for {engine} {planned}'s rules, flags are {version}'s: re-plan with "
                 f"--engine-version {ctx.options.engine_version} for that version's memory rules",)
    return ChosenFlags(table=flag_table(f"{stem}-{version}"), why=why, notes=notes)


def checked_kv_value(ctx: ExportContext, target: str, table: FlagTable, value: str, label: str) -> str:
    """`value` for --kv-cache-dtype if the chosen flag list allows it; else refused (exit 2) naming the
    plan's KV and activation formats and the values that version takes."""
    L, wl = ctx.manifest.layout, ctx.manifest.workload
    if not table.allows("kv-cache-dtype", value):
        raise cannot(target, "layout.kv_cache_dtype",
                     f"{label} {table.version} has no {L.kv_cache_dtype} KV cache beside {wl.activation_dtype} activations "
                     f"(--kv-cache-dtype takes {', '.join(map(str, table.flags['kv-cache-dtype']['choices']))})",
                     "re-plan with --kv-cache-dtype auto (the activation dtype) or fp8")
    return value


Arg = tuple[str, "str | int | float | Words | None"]


def command(table: FlagTable | None, program: Sequence[str], args: Iterable[Arg], *, tail: Sequence[str] = (),
            indent: str = "    ") -> str:
    """`program --flag value ... tail`, one flag per line; every flag checked against `table`."""
    head = " ".join(_quote(p) for p in program)
    lines = [head]
    for name, value in args:
        prefix = table.prefix if table is not None else "--"
        if isinstance(value, Words):
            words = [_text(w) for w in value]
            if table is not None:
                for w in words:
                    table.check(name, w)
            lines.append(f"{prefix}{name} " + " ".join(_quote(w) for w in words))
            continue
        v = None if value is None else (value if isinstance(value, Raw) else _text(value))
        if table is not None:
            table.check(name, v)
        lines.append(f"{prefix}{name}" if v is None else f"{prefix}{name} {_quote(v)}")
    if tail:
        lines.append(" ".join(_quote(t) for t in tail))
    return f" \\\n{indent}".join(lines)


def argv(cmd: str) -> list[str]:
    """A rendered command back as argv (continuations joined), as a shell would split it."""
    return shlex.split(cmd.replace("\\\n", " "))


def _text(value: str | int | float) -> str:
    if isinstance(value, bool):
        raise TypeError("booleans are switches: pass None as the value")
    if isinstance(value, float):
        return f"{value:.2f}" if value < 1 else repr(value)
    return str(value)


def _quote(v: str) -> str:
    return f'"{v}"' if isinstance(v, Raw) and not v.isidentifier() else (v if isinstance(v, Raw) else shlex.quote(v))


def script(lines: Iterable[str], *, header: Sequence[str]) -> str:
    """A bash script: shebang, strict mode, the header comments, then `lines`."""
    out = ["#!/usr/bin/env bash", *(f"# {comment(h)}" if h else "#" for h in header), "set -euo pipefail", ""]
    out.extend(lines)
    return "\n".join(out).rstrip("\n") + "\n"


def plan_header(m: DeploymentManifest, target: str, table: FlagTable | ChosenFlags | None = None) -> list[str]:
    """Comment lines that say which plan this is and what shardplan predicted for it, and which flag
    list the commands were checked against (with why, for a list `engine_flags` chose)."""
    chosen = table if isinstance(table, ChosenFlags) else None
    table = chosen.table if chosen is not None else table
    L, hw = m.layout, m.hardware
    deg = f"tp={L.tp} pp={L.pp} dp={L.dp}" + (f" cp={L.cp}" if L.cp > 1 else "") + (f" ep={L.ep}" if L.ep > 1 else "")
    mem = m.predicted.memory
    lines = [
        f"shardplan {m.shardplan_version} export --to {target}: {m.model.name} on {hw.num_gpus} x {hw.gpu_model} "
        f"({hw.num_nodes} node(s) of {gpus_per_node_used(m)}), {deg}",
        f"predicted peak per GPU: {mem.per_gpu_bytes['total'] / GIB:.2f} GiB of {hw.memory_capacity_bytes / GIB:.2f} GiB "
        f"(binding: stage {mem.binding_stage}, {mem.binding_component})",
    ]
    if chosen is not None:
        lines.append(f"flags checked against {DISPLAY_NAMES.get(table.tool, table.tool)} {table.version} "
                     f"({chosen.why}; {table.sources[0]})")
        lines += engine_lines(m, target, None) + list(chosen.notes)
    elif table is not None:
        lines.append(f"flags checked against {table.pinned} ({table.sources[0]})")
        lines += engine_lines(m, target, table)
    else:
        lines += engine_lines(m, target, table)
    return [comment(line) for line in lines]  # names come from the plan file, which may be anyone's


def engine_lines(m: DeploymentManifest, target: str, table: FlagTable | None) -> list[str]:
    """Which engine and version the plan's memory was sized for, and a warning when the export
    targets another engine, or flags of another version, whose rules size memory differently."""
    wl = m.workload
    if wl.kind != "inference" or wl.engine_version is None:
        return []
    lines = [f"memory sized for {wl.engine} {wl.engine_version}'s rules"]
    if target in ("vllm", "sglang") and target != wl.engine:
        lines.append(f"warning: planned with {wl.engine}'s memory rules, exported for {target}, which sizes its KV "
                     f"cache differently: re-plan with --engine {target}")
    elif table is not None and table.tool == wl.engine and table.version != wl.engine_version:
        lines.append(f"note: planned for {wl.engine} {wl.engine_version}, flags are {table.version}'s: run it on "
                     f"{table.version}, or re-plan with --engine-version {table.version}")
    return lines


def finetune_files(wl: TrainingWorkloadSection) -> tuple[list[ExportFile], list[str]]:
    """A LoRA/QLoRA plan's fine-tuning setup as the trainers take it: `peft_config.json` holds
    `peft.LoraConfig` keyword arguments, `bnb_config.json` transformers' `BitsAndBytesConfig` ones
    (NF4, double quantization as planned, bf16 compute; the quantized weights stored as bf16 so
    that FSDP and ZeRO-3 can shard them: bnb_4bit_quant_storage), and how to load them."""
    if wl.finetune == "full":
        return [], []
    targets: str | list[str] = "all-linear" if wl.lora_targets == ["all-linear"] else list(wl.lora_targets)
    lora = {"r": wl.lora_rank, "lora_alpha": wl.lora_alpha, "lora_dropout": wl.lora_dropout,
            "target_modules": targets, "bias": "none", "task_type": "CAUSAL_LM"}
    files = [ExportFile("peft_config.json", json.dumps(lora, indent=2) + "\n")]
    notes = ["wrap the model with peft.get_peft_model(model, peft.LoraConfig(**json.load(open('peft_config.json'))))"]
    if wl.finetune == "qlora":
        bnb = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
               "bnb_4bit_use_double_quant": wl.base_format == "nf4-dq",
               "bnb_4bit_compute_dtype": "bfloat16", "bnb_4bit_quant_storage": "bfloat16"}
        files.append(ExportFile("bnb_config.json", json.dumps(bnb, indent=2) + "\n"))
        notes.insert(0, "load the base with quantization_config=transformers.BitsAndBytesConfig("
                        "**json.load(open('bnb_config.json'))), then peft.prepare_model_for_kbit_training(model)")
    if wl.paged_optimizer or wl.optimizer == "adamw8bit":
        name = {(True, True): "paged_adamw_8bit", (True, False): "paged_adamw_32bit",
                (False, True): "adamw_bnb_8bit"}[(wl.paged_optimizer, wl.optimizer == "adamw8bit")]
        notes.append(f"the plan counts bitsandbytes optimizer states: TrainingArguments(optim='{name}')")
    return files, notes
