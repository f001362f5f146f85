"""Reading model specs and hardware profiles from disk: the I/O edge of `specs/`.

Every failure becomes an InputFileError/UnknownNameError naming the file, the field and
the fix. YAML is read with a safe loader that rejects duplicate keys and alias bombs.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import difflib
import json
import os
import re
import reprlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import yaml
from pydantic import Field, ValidationError

from shardplan import fileio
from shardplan.errors import InputFileError, ShardplanError, UnknownNameError
from shardplan.specs._base import StrictModel
from shardplan.specs.hardware import HardwareProfile, HardwareProfileFile, profile_from_file
from shardplan.specs import hub
from shardplan.specs.hf import MissingField, config_dtype, translate
from shardplan.specs.model import ModelSpec

MAX_INPUT_FILE_BYTES = 16 * 1024 * 1024
MAX_YAML_ALIASES = 64
# Limits on the parsed data, aliases expanded: a real config holds a few hundred values a few
# levels deep. A YAML alias bomb (64 aliases can still stand for 3^21 values) or a deeply
# nested file is refused here, before any code walks it.
MAX_NESTING_DEPTH = 64
MAX_VALUES = 1_000_000

# ----- where the bundled catalogs live -----------------------------------------------------


def _catalog_dir(kind: str) -> Path:
    """Bundled catalog folder: $SHARDPLAN_DATA_DIR/<kind>, the source checkout, or the
    wheel's <prefix>/share/shardplan/<kind>."""
    env = os.environ.get("SHARDPLAN_DATA_DIR")
    candidates = [Path(env) / kind] if env else []
    candidates += [
        Path(__file__).resolve().parents[2] / kind,
        Path(sys.prefix) / "share" / "shardplan" / kind,
    ]
    for c in candidates:
        if c.is_dir():
            return c
    return candidates[0]


def model_specs_dir() -> Path:
    return _catalog_dir("model_specs")


def hardware_profiles_dir() -> Path:
    return _catalog_dir("hardware_profiles")


def bundled_names(folder: Path) -> list[str]:
    if not folder.is_dir():
        return []
    return sorted(p.stem for p in folder.glob("*.yaml"))


# ----- parsing -----------------------------------------------------------------------------


class _UniqueKeys:
    """A YAML mapping with a key twice is refused (PyYAML keeps the last one silently)."""

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:  # noqa: D102
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)  # type: ignore[attr-defined]
            try:
                hashable = key in seen
            except TypeError:
                raise yaml.constructor.ConstructorError(
                    None, None, "a mapping key must be a plain value", key_node.start_mark
                ) from None
            if hashable:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)  # type: ignore[misc]


class _StrictSafeLoader(_UniqueKeys, yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys and more than MAX_YAML_ALIASES aliases."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._num_aliases = 0

    def compose_node(self, parent: Any, index: Any) -> Any:  # noqa: D102
        if self.check_event(yaml.AliasEvent):
            self._num_aliases += 1
            if self._num_aliases > MAX_YAML_ALIASES:
                raise yaml.YAMLError(f"more than {MAX_YAML_ALIASES} YAML aliases (an alias bomb?)")
        return super().compose_node(parent, index)


class _StrictCSafeLoader(_UniqueKeys, getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    """libyaml's parser (about 8x faster) under the same duplicate-key check. Its composer is C,
    so aliases cannot be counted as they are composed: `_parse` uses it only for text without an
    anchor, which therefore holds no alias. An anchor is '&' and at least one anchor character
    (YAML 1.1/1.2 ns-anchor-char: not a space, not a flow indicator), so a bare '&' in prose ("top-p
    & top-k") does not send a file to the slow loader."""


_MAY_HOLD_ANCHOR = re.compile(r"&[^\s,\[\]{}]")


def _check_shape(data: Any, label: str) -> None:
    """Refuse data nested deeper than MAX_NESTING_DEPTH or holding more than MAX_VALUES values
    once shared (aliased) parts are counted each time they appear. Iterative, and it stops at
    the first limit, so a bomb or a cycle costs at most MAX_VALUES steps."""
    stack: list[tuple[Any, int]] = [(data, 1)]
    count = 0
    while stack:
        item, depth = stack.pop()
        count += 1
        if count > MAX_VALUES:
            raise InputFileError(f"holds more than {MAX_VALUES} values (YAML aliases counted each time they are used)",
                                 source=label, hint="remove the aliases (&name / *name) or pass the config itself")
        if isinstance(item, dict):
            children: Any = [*item.keys(), *item.values()]
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        if depth >= MAX_NESTING_DEPTH and children:
            raise InputFileError(f"nested more than {MAX_NESTING_DEPTH} levels deep", source=label,
                                 hint="a config is a few levels of keys; check the file")
        stack.extend((c, depth + 1) for c in children)


def _read_bytes(path: Path, label: str) -> bytes:
    """At most MAX_INPUT_FILE_BYTES of a regular file: never a device, FIFO or socket (a plan
    naming /dev/zero or /dev/stdin as its model source must not hang or fill memory)."""
    return fileio.read_regular_file_bytes(path, max_bytes=MAX_INPUT_FILE_BYTES, label=label, what="a config",
                                          hint="pass the config file itself, not a checkpoint")


def read_structured(path: Path, label: str | None = None) -> Any:
    """Parse a YAML or JSON file into plain data, with errors that name the file (or `label`,
    e.g. a Hub id for a cached config.json) and line."""
    label = label or str(path)
    try:
        text = _read_bytes(path, label).decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputFileError(f"not UTF-8 text (byte {e.start})", source=label, hint="save the file as UTF-8") from None
    data = _parse(text, path, label)
    _check_shape(data, label)
    return data


# Every shardplan file is a few levels deep: one nested past Python's recursion limit is not one of them.
NESTING_HINT = "a plan, spec, profile or lengths file nests a few levels; check that this is the file meant"


def _parse(text: str, path: Path, label: str) -> Any:
    if path.suffix.lower() == ".json":
        try:
            return json.loads(text, parse_constant=fileio.refuse_json_constant,
                              object_pairs_hook=fileio.unique_json_keys)
        except RecursionError:
            raise InputFileError("JSON nested too deeply", source=label, hint=NESTING_HINT) from None
        except json.JSONDecodeError as e:
            raise InputFileError(f"invalid JSON at line {e.lineno} column {e.colno}: {e.msg}", source=label,
                                 hint="fix the JSON syntax") from None
        except ValueError as e:  # a key twice, NaN or Infinity, an integer too long to convert
            too_long = fileio.long_integer(e)
            if too_long:
                raise InputFileError(f"invalid JSON: {too_long}", source=label,
                                     hint="check that this is the file meant, and the number in it") from None
            raise InputFileError(f"the JSON {e}", source=label,
                                 hint="give each key once, and numbers as numbers") from None
    try:
        loader = _StrictSafeLoader if _MAY_HOLD_ANCHOR.search(text) else _StrictCSafeLoader
        return yaml.load(text, Loader=loader)  # noqa: S506 - SafeLoader subclasses
    except RecursionError:
        raise InputFileError("YAML nested too deeply", source=label, hint=NESTING_HINT) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1} column {mark.column + 1}: " if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e)
        if "maximum nesting depth" in problem:  # libyaml's own limit (Python's parser: RecursionError)
            raise InputFileError("YAML nested too deeply", source=label, hint=NESTING_HINT) from None
        raise InputFileError(f"invalid YAML at {where}{problem}", source=label, hint="fix the YAML syntax") from None


_UNION_MEMBER = re.compile(r"[a-z-]+\[.*\]|str|int|float|bool")
_SHORT_REPR = reprlib.Repr()
_SHORT_REPR.maxlevel, _SHORT_REPR.maxstring, _SHORT_REPR.maxother = 3, 80, 80


def validation_error(e: ValidationError, source: str, prefix: str = "", known: list[str] | None = None) -> InputFileError:
    """The first pydantic error as one line naming the file and the dotted field."""
    errors = e.errors(include_url=False)
    # A misspelt key shows up twice (unknown + missing): report the unknown one, it has the fix.
    err = next((x for x in errors if x.get("type") == "extra_forbidden"), errors[0])
    # pydantic names the union member it tried ('sources.dict[str,str]'); the file has no such key.
    loc = ".".join(str(p) for p in err.get("loc", ()) if not _UNION_MEMBER.fullmatch(str(p)))
    field = ".".join(p for p in (prefix, loc) if p) or None
    kind = err.get("type", "")
    msg = err.get("msg", "invalid value")
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    hint = None
    if kind == "extra_forbidden":
        msg = "unknown key"
        last = str(err["loc"][-1]) if err.get("loc") else ""
        close = difflib.get_close_matches(last, known or [], n=1)
        hint = f"did you mean '{close[0]}'?" if close else "remove it; see the documented keys"
    elif kind == "missing":
        msg = "required key is missing"
        hint = "add it"
    elif "input" in err and err.get("loc"):
        shown = _SHORT_REPR.repr(err["input"])  # bounded: the input may be huge or shared many times over
        if len(shown) > 60:
            shown = shown[:57] + "..."
        msg = f"{msg} (got {shown})"
    return InputFileError(msg, source=source, field=field, hint=hint)


def _expect_mapping(data: Any, source: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise InputFileError(
            f"expected a mapping of keys to values at the top level, got {type(data).__name__}", source=source
        )
    return data


# ----- models ------------------------------------------------------------------------------


class ModelSpecFile(StrictModel):
    """A shardplan model file: either an HF config (`hf_config:`) or the spec fields
    (`architecture:`), with where its numbers come from."""

    name: str = Field(..., min_length=1)
    hf_id: str | None = None
    sources: dict[str, str] | str | None = None
    published_num_params: int | None = Field(None, gt=0)
    notes: str | None = None
    hf_config: dict[str, Any] | None = None
    architecture: dict[str, Any] | None = None


@dataclass(frozen=True)
class LoadedModel:
    spec: ModelSpec
    origin: str  # the file it came from
    published_num_params: int | None = None
    hf_id: str | None = None
    sources: dict[str, str] | None = None
    notes: str | None = None


# ModelSpec field -> the HF key users see, for error messages about HF configs.
_HF_KEY_FOR_FIELD = {
    "num_layers": "num_hidden_layers",
    "num_kv_heads": "num_key_value_heads",
    "moe.num_experts": "num_local_experts / num_experts / n_routed_experts",
    "moe.num_experts_per_token": "num_experts_per_tok",
    "moe.expert_intermediate_size": "moe_intermediate_size",
}


_HF_WORDS = {"num_kv_heads": "num_key_value_heads", "num_layers": "num_hidden_layers"}

# Whether a translation's warnings and notes go to stderr (the user's own config: yes); shipped
# data read in bulk (`shardplan validate`'s corpus) turns them off with `quiet_notes()`.
_NOTES_TO_STDERR: contextvars.ContextVar[bool] = contextvars.ContextVar("notes_to_stderr", default=True)


@contextlib.contextmanager
def quiet_notes() -> Iterator[None]:
    """Load models without printing their translations' warnings and notes (shipped, known data)."""
    token = _NOTES_TO_STDERR.set(False)
    try:
        yield
    finally:
        _NOTES_TO_STDERR.reset(token)


def _spec_from_hf(cfg: dict[str, Any], name: str, source: str, prefix: str = "") -> ModelSpec:
    _expect_hf_config(cfg, source, prefix)
    try:
        translation = translate(cfg, name)
        fields = translation.fields
        # Keys no translation read, and how a spec was derived: on stderr, never dropped silently.
        if _NOTES_TO_STDERR.get():
            for line in [f"warning: {source}: {w}" for w in translation.warnings] + [f"note: {n}" for n in translation.notes]:
                print(line, file=sys.stderr)
    except MissingField as e:
        raise InputFileError(
            "required key is missing", source=source, field=prefix + e.key, hint="add it as in the model's config.json"
        ) from None
    except ShardplanError as e:
        e.source = e.source or source
        if e.field:
            e.field = prefix + e.field
        raise
    except ValidationError as e:  # a nested spec the translation builds (MoESpec, MLASpec, ...)
        raise _in_hf_words(validation_error(e, source), prefix) from None
    except (TypeError, ValueError, AttributeError) as e:
        raise InputFileError(f"cannot read the config: {e}", source=source) from None
    try:
        return ModelSpec(**fields, source=source)
    except ValidationError as e:
        raise _in_hf_words(validation_error(e, source), prefix) from None


def _in_hf_words(err: InputFileError, prefix: str) -> InputFileError:
    """A spec's validation error in the config's language: its field as the HF key (under `prefix`),
    spec field names in the message as HF keys."""
    if err.field:
        err.field = prefix + _HF_KEY_FOR_FIELD.get(err.field, err.field)
    for spec_name, hf_key in _HF_WORDS.items():
        err.message = re.sub(rf"\b{spec_name}\b", hf_key, err.message)
    return err


def model_from_data(data: Any, source: str, default_name: str) -> LoadedModel:
    data = _expect_mapping(data, source)
    if "hf_config" in data or "architecture" in data:
        try:
            f = ModelSpecFile.model_validate(data)  # not **data: YAML keys need not be strings
        except ValidationError as e:
            raise validation_error(e, source, known=list(ModelSpecFile.model_fields)) from None
        if (f.hf_config is None) == (f.architecture is None):
            raise InputFileError(
                "give exactly one of 'hf_config' and 'architecture'", source=source, hint="remove one of them"
            )
        sources = f.sources if isinstance(f.sources, dict) else ({"spec": f.sources} if f.sources else None)
        if f.hf_config is not None:
            spec = _spec_from_hf(f.hf_config, f.name, source, prefix="hf_config.")
        else:
            arch = dict(f.architecture or {})
            for reserved in ("name", "source"):
                if reserved in arch:
                    raise InputFileError(
                        "set at the top level, not inside 'architecture'",
                        source=source,
                        field=f"architecture.{reserved}",
                        hint=f"move '{reserved}' up one level",
                    )
            try:  # the dtype first, for its fix (ModelSpec refuses an unknown one too, without one)
                config_dtype(arch, None)
            except InputFileError as e:
                raise InputFileError(e.message, source=source, field=f"architecture.{e.field}", hint=e.hint) from None
            try:
                spec = ModelSpec.model_validate({**arch, "name": f.name, "source": source})
            except ValidationError as e:
                raise validation_error(e, source, prefix="architecture", known=list(ModelSpec.model_fields)) from None
        return LoadedModel(spec, source, f.published_num_params, f.hf_id, sources, f.notes)
    # A bare Hugging Face config.json.
    return LoadedModel(_spec_from_hf(data, default_name, source), source)


# Top-level keys that tell another shardplan file from a model (hardware_profiles/*.yaml; a plan).
_HARDWARE_KEYS = frozenset({"gpu", "node", "efficiency", "runtime"})
_PLAN_KEYS = frozenset({"schema_version", "layout", "predicted", "placement"})


def _expect_hf_config(data: dict[str, Any], source: str, prefix: str = "") -> None:
    """A config.json (or a model YAML's `hf_config:` block, under `prefix`) names its model type:
    model_type, architectures, or a text_config holding them. A whole file that does not is refused
    for what it looks like, with the fix for that."""
    if any(k in data for k in ("model_type", "architectures", "text_config")):
        return
    if not prefix:
        _refuse_other_file(data, source)
    raise InputFileError("required key is missing: a Hugging Face config.json names its model_type (or "
                         "architectures)", source=source, field=prefix + "model_type",
                         hint='add "model_type" (e.g. "llama") as in the model\'s config.json, or write a '
                              "shardplan model YAML with an architecture: block")


def _refuse_other_file(data: dict[str, Any], source: str) -> None:
    """Refuse a hardware profile, a plan or a model YAML without its block, given as a model."""
    keys = {k for k in data if isinstance(k, str)}
    hardware = sorted(keys & _HARDWARE_KEYS)
    if len(hardware) >= 2:
        named = ", ".join(f"'{k}'" for k in hardware)
        raise InputFileError(f"not a model: the file is a hardware profile (it has {named})", source=source,
                             field="model_type", hint="pass a hardware profile with -H/--hardware, and as MODEL a "
                                                      "bundled name, a config.json or a model YAML")
    if len(keys & _PLAN_KEYS) >= 2:
        raise InputFileError("not a model: the file is a shardplan plan", source=source, field="model_type",
                             hint="pass a plan to the commands that take one (show, export, checkpoint, verify, "
                                  "replan), and as MODEL a bundled name, a config.json or a model YAML")
    if keys and keys <= set(ModelSpecFile.model_fields):
        raise InputFileError("a shardplan model YAML needs an 'architecture:' block (or 'hf_config:'), and this one "
                             "has neither", source=source, field="architecture",
                             hint="add architecture: with the ModelSpec fields (hidden_size, num_layers, "
                                  "num_attention_heads, ...; `shardplan models show debug --json` lists them), or "
                                  "hf_config: with the model's config.json")


def _name_from_path(path: Path) -> str:
    if path.name == "config.json":
        return path.parent.name or "model"
    return path.stem


def _too_long(name_or_path: str) -> bool:
    """Whether no file can have this name (fileio.no_file_can_have_name)."""
    return fileio.no_file_can_have_name(name_or_path)


def _bounded(name_or_path: str, kind: str) -> str:
    """`name_or_path` as given, or an error when no file or catalog entry can have it; the error
    quotes the start of it only."""
    if not name_or_path.strip():
        raise InputFileError(f"an empty {kind} name", source="''", hint=f"name a bundled {kind} or a file")
    if _too_long(name_or_path):
        raise UnknownNameError(f"unknown {kind}: a name of {len(name_or_path):,} characters",
                               source=_quoted(name_or_path), hint=f"name a bundled {kind} or a file")
    return name_or_path


def _quoted(name: str, limit: int = 60) -> str:
    return name if len(name) <= limit else name[:limit] + "..."


def load_model(name_or_path: str) -> LoadedModel:
    """A bundled model by name, an HF config.json, a directory holding one, a shardplan YAML,
    or a Hugging Face Hub id `org/name[@revision]`. In that order: an existing path wins, then
    a bundled name, then the Hub (`hf:org/name` goes to the Hub directly)."""
    if name_or_path.startswith(hub.HUB_PREFIX) or (_too_long(name_or_path) and hub.is_hub_candidate(name_or_path)):
        return _load_hub_model(hub.parse_hub_id(name_or_path))  # its parser bounds an id in its own words
    _bounded(name_or_path, "model")
    if name_or_path.startswith(hub.HUB_PREFIX):
        return _load_hub_model(hub.parse_hub_id(name_or_path))
    path = Path(name_or_path).expanduser()
    looks_like_path = os.sep in name_or_path or path.suffix.lower() in (".json", ".yaml", ".yml")
    if path.is_dir():
        cfg = path / "config.json"
        if not cfg.is_file():
            raise InputFileError(
                "directory has no config.json", source=str(path), hint="point at a Hugging Face model directory"
            )
        path = cfg
    elif not path.exists():
        if hub.is_hub_candidate(name_or_path):  # org/name: bundled names hold no '/'
            return _load_hub_model(hub.parse_hub_id(name_or_path))
        if looks_like_path:
            raise InputFileError("file not found", source=str(path), hint="check the path")
        path = _bundled_file(model_specs_dir(), name_or_path, "model", "shardplan models")
    data = read_structured(path)
    return model_from_data(data, str(path), _name_from_path(path))


def _load_hub_model(ref: hub.HubRef) -> LoadedModel:
    """The config.json of a Hub repository (cache first), read with the same bounded reader as
    a local one; recorded as `hf:org/name@<commit>` with `hf_id` org/name."""
    got = hub.download(ref, "config.json")
    data = read_structured(got.path, label=f"{got.origin}/config.json")
    loaded = model_from_data(data, got.origin, ref.name)
    return dataclasses.replace(loaded, hf_id=loaded.hf_id or ref.repo_id)


def list_models() -> list[LoadedModel]:
    return [load_model(str(model_specs_dir() / f"{n}.yaml")) for n in bundled_names(model_specs_dir())]


# ----- hardware ----------------------------------------------------------------------------


def hardware_from_data(data: Any, source: str) -> HardwareProfile:
    data = _expect_mapping(data, source)
    try:
        f = HardwareProfileFile.model_validate(data)
    except ValidationError as e:
        known = _known_keys(e)
        raise validation_error(e, source, known=known) from None
    return profile_from_file(f)


def _known_keys(e: ValidationError) -> list[str]:
    """Field names at the level of the first error, for 'did you mean' hints."""
    from shardplan.specs import hardware as hw

    errors = e.errors()
    first = next((x for x in errors if x.get("type") == "extra_forbidden"), errors[0])
    loc = [p for p in first.get("loc", ()) if isinstance(p, str)][:-1]
    model: Any = hw.HardwareProfileFile
    for part in loc:
        ann = model.model_fields.get(part)
        if ann is None or not hasattr(ann.annotation, "model_fields"):
            break
        model = ann.annotation
    return list(model.model_fields)


def hardware_path(name_or_path: str) -> Path:
    """The file a hardware argument names: a path as given, or a bundled profile's name."""
    path = Path(_bounded(name_or_path, "hardware")).expanduser()
    if path.exists():
        return path
    if os.sep in name_or_path or path.suffix.lower() in (".yaml", ".yml", ".json"):
        raise InputFileError("file not found", source=str(path), hint="check the path")
    return _bundled_file(hardware_profiles_dir(), name_or_path, "hardware", "shardplan hardware")


def _bundled_file(folder: Path, name: str, kind: str, list_command: str) -> Path:
    """A bundled catalog entry by name, matched without regard to case (Llama-3.1-70B is
    llama-3.1-70b), or an error suggesting the closest names."""
    by_lower = {n.lower(): n for n in bundled_names(folder)}
    found = by_lower.get(name.lower())
    if found is not None:
        return folder / f"{found}.yaml"
    close = [by_lower[c] for c in difflib.get_close_matches(name.lower(), list(by_lower), n=3, cutoff=0.4)]
    hint = f"did you mean {', '.join(close)}?" if close else f"run `{list_command}` for the list"
    raise UnknownNameError(f"unknown {kind} '{_quoted(name)}'", hint=hint)


def load_hardware(name_or_path: str) -> HardwareProfile:
    path = hardware_path(name_or_path)
    return own_cases_resolved(hardware_from_data(read_structured(path), str(path)), path)


def own_cases_resolved(hw: HardwareProfile, path: Path) -> HardwareProfile:
    """`hw`, read from `path`, with its measured cases pointed at the profile itself (they were
    measured on this machine, whatever the file is called now) and their relative model files
    at the profile's folder, so that each case predicts as it stands anywhere."""
    if not hw.measured_cases:
        return hw
    own = str(path.resolve())

    def resolved(model: str | None) -> str | None:
        if model is None or Path(model).is_absolute() or not model.endswith((".yaml", ".yml", ".json")):
            return model
        return str((path.parent / model).resolve())

    cases = tuple(c.model_copy(update={"hardware": own, "model": resolved(c.model)}) for c in hw.measured_cases)
    return dataclasses.replace(hw, measured_cases=cases)


def list_hardware() -> list[HardwareProfile]:
    return [load_hardware(str(hardware_profiles_dir() / f"{n}.yaml")) for n in bundled_names(hardware_profiles_dir())]
