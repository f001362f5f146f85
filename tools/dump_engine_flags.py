"""Dump a serving engine's command-line flags from its own parser into the packaged flag list.

    python tools/dump_engine_flags.py vllm 0.33.0            # -> shardplan/exporters/flags/vllm-0.33.0.yaml
    python tools/dump_engine_flags.py sglang 0.5.23 --scratch /tmp/sg
    python tools/dump_engine_flags.py vllm 0.11.0 --mode ast  # no import: read add_argument calls with `ast`

What it does (needs the network: PyPI only):
1. `pip download --no-deps <engine>==<version>` into a scratch folder; the wheel's name and sha256
   go into the file as its source. Nothing of the engine's code is copied into the repository:
   only option names and the facts argparse/click holds about them.
2. Unzips the engine's Python sources (no compiled extensions) into the scratch folder.
3. `--mode import` (the default): builds the parser the engine's server itself builds, in a scratch
   virtual environment that sees this interpreter's packages (torch for CPU among them) and gets the
   engine's own requirements minus the GPU-only ones (CUDA kernels, torch builds); a module that is
   still missing is installed by name, up to a bound. Then walks the parser's actions:
   - vLLM: `make_arg_parser(FlexibleArgumentParser())` (`vllm serve`), with VLLM_TARGET_DEVICE=cpu and
     field help texts on (as `vllm serve --help` builds them), so deprecations in help show;
   - SGLang: `ServerArgs.add_cli_args(argparse.ArgumentParser())` (`python -m sglang.launch_server`).
   `--mode ast` reads the same methods' source with Python's `ast` instead (literal `add_argument`
   and click `@click.option` calls only: flags that a release builds from dataclass fields are not
   seen that way, so the import mode is the one to trust; the ast mode is the fallback and is what
   the tests exercise, on a tiny fixture source).
4. Reads, for the flags an engine validates after parsing (AFTER_PARSING: vLLM's parser has no
   choices for --quantization in 0.11.0 and 0.33.0, nor for --kv-cache-dtype in 0.33.0, whose field is
   `CacheDType | str`; it checks the value when it builds the config), the allowed values from that
   release's own source in the same wheel with `ast`: a `Literal[...]` alias, or a list or tuple of
   strings, assigned to a named module constant. A flag whose parser has choices keeps them.
5. Writes `shardplan/exporters/flags/<engine>-<version>.yaml`: version, date, source (wheel name and
   sha256), and per long option: takes_value, choices (as argparse enforces them, or, with
   `choices_source: <file in the wheel> <symbol>`, as read in step 4), and `deprecated: true` with
   the help text's note when the engine marks it so (a Deprecated* action class, argparse's
   `deprecated=True`, or help that starts with "[DEPRECATED]"/"Deprecated" or says the flag "is
   deprecated").

TensorRT-LLM is not dumped: PyPI carries only a stub sdist for it (its wheels are on NVIDIA's index,
which this project's machines do not reach). TGI's launcher is Rust (clap): its list stays by hand.
"""

from __future__ import annotations

import argparse
import ast
import datetime as _dt
import hashlib
import json
import os
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

REPO = Path(__file__).resolve().parents[1]
FLAGS_DIR = REPO / "shardplan" / "exporters" / "flags"
INDEX = "https://pypi.org/simple"
MAX_MISSING_INSTALLS = 30  # modules installed by name after the requirements, before giving up on import mode


@dataclass(frozen=True)
class Engine:
    package: str  # PyPI name
    top: str  # import package inside the wheel
    command: str  # how the server is started
    sources: tuple[str, ...]  # files (inside the wheel) whose parser is read, for the file's sources and ast mode
    methods: tuple[tuple[str, str], ...]  # (class or "", function) read in ast mode, per source


ENGINES = {
    "vllm": Engine("vllm", "vllm", "vllm serve",
                   ("vllm/engine/arg_utils.py", "vllm/entrypoints/openai/cli_args.py",
                    "vllm/entrypoints/common/cli_args.py"),  # make_arg_parser moved to common/ after 0.11
                   (("EngineArgs", "add_cli_args"), ("", "make_arg_parser"), ("", "make_arg_parser"))),
    "sglang": Engine("sglang", "sglang", "python -m sglang.launch_server",
                     ("sglang/srt/server_args.py",), (("ServerArgs", "add_cli_args"),)),
    "trtllm": Engine("tensorrt-llm", "tensorrt_llm", "trtllm-serve",
                     ("tensorrt_llm/commands/serve.py",), (("", "serve"),)),
}

# Flags whose values the engine checks after parsing, not through argparse choices: flag -> the places
# (file inside the wheel, module-level symbol) that list the values, tried in order, the first found
# wins. vLLM: `literal_to_kwargs` (vllm/engine/arg_utils.py) makes a `Literal | str` field a metavar;
# get_quantization_config refuses a method not in QUANTIZATION_METHODS = list(get_args(QuantizationMethods)),
# CacheConfig._validate_cache_dtype one not in KV_CACHE_DTYPES = list(get_args(CacheDType)) (v0.33.0).
# Plugins may register more of either at run time; the lists hold what the release itself ships.
# SGLang: --quantization, --kv-cache-dtype, --attention-backend (and its other enumerated flags) are
# argparse choices in 0.5.3 and 0.5.23 (QUANTIZATION_CHOICES, ATTENTION_BACKEND_CHOICES: 0.5.3 in
# sglang/srt/server_args.py, 0.5.23 in sglang/srt/arg_groups/choices.py through the fields' Arg(choices=)):
# nothing to add.
AFTER_PARSING: dict[str, dict[str, tuple[tuple[str, str], ...]]] = {
    "vllm": {
        "quantization": (("vllm/model_executor/layers/quantization/__init__.py", "QuantizationMethods"),),
        "kv-cache-dtype": (("vllm/config/cache.py", "CacheDType"),),
    },
}

# Requirements that only run on a GPU (kernels, CUDA builds of torch): never installed for a parser dump.
GPU_ONLY = re.compile(r"^(torch|torchaudio|torchvision|torchcodec|nvidia-|nvshmem|cuda-|flashinfer|flash-attn|tilelang|"
                      r"apache-tvm|humming|quack|tokenspeed|pynvvideocodec|nvtx|fastsafetensors|instanttensor|"
                      r"triton|xformers|ray|cupy|sgl-|sglang-kernel|torch-memory-saver|torch_memory_saver|numba|"
                      r"deepseek-recipe|kernels)", re.I)


@dataclass
class Flag:
    """One long option as the parser holds it."""
    name: str  # without the leading dashes
    takes_value: bool
    choices: list[Any] | None = None
    deprecated: bool = False
    note: str | None = None  # the deprecation's help text
    optional_value: bool = False  # nargs='?': the flag alone or with a value
    choices_source: str | None = None  # "<file in the wheel> <symbol>" when the choices are not argparse's

    def as_yaml(self) -> dict[str, Any]:
        out: dict[str, Any] = {"takes_value": self.takes_value}
        if self.optional_value:
            out["optional_value"] = True
        if self.choices:
            out["choices"] = self.choices
            if self.choices_source:
                out["choices_source"] = self.choices_source
        if self.deprecated:
            out["deprecated"] = True
            if self.note:
                out["note"] = self.note
        return out


# ----- pure parts (tested without the network) -------------------------------------------

# "[DEPRECATED] ...", "Deprecated. Use ...", "(Deprecated: use ...)" at the start of the help or of a paragraph
# (vLLM's field docs: "Deprecated: vLLM IR is being removed ..."); "--x is deprecated ..." in the first clause.
_DEPRECATED_HELP = re.compile(r"^\s*[\[(]?\s*deprecated\b|^[^.;\n]*\bis deprecated\b", re.I | re.M)


def is_deprecated(*, action_class: str = "", deprecated_attr: Any = False, help_text: str | None = None) -> bool:
    """Whether the engine marks an option deprecated: a Deprecated* action class (SGLang's
    DeprecatedStoreTrueAction), argparse's own `deprecated=True` (Python 3.13), or help text that
    starts with "[DEPRECATED]" / "Deprecated" / "(Deprecated: ...)" (the help's or a paragraph's
    start) or whose first clause says it "is deprecated" (vLLM's "--log-config-file is deprecated and
    will be removed ..."). Help that only mentions another flag's or a fallback's deprecation
    ("Replaces the deprecated --grpc-mode"; "... The fallback to that flag is deprecated") does not count."""
    return ("deprecated" in action_class.lower() or deprecated_attr is True
            or bool(help_text and _DEPRECATED_HELP.search(help_text)))


def flag_from_action(options: Iterable[str], *, nargs: Any, choices: Any, action_class: str,
                     deprecated_attr: Any, help_text: str | None) -> list[Flag]:
    """The long options of one argparse action (short aliases are not keys)."""
    takes = nargs != 0
    optional = nargs == "?"
    ch = None
    if choices is not None and not isinstance(choices, (str, bytes)):
        values = [c for c in choices if c is not None]
        if all(isinstance(c, (str, int, float)) for c in values) and values:
            ch = sorted(values, key=str) if isinstance(choices, (set, frozenset)) else values
    dep = is_deprecated(action_class=action_class, deprecated_attr=deprecated_attr, help_text=help_text)
    note = None
    if dep and help_text:
        hit = _DEPRECATED_HELP.search(help_text)
        note = " ".join(help_text[hit.start() if hit else 0:].split())[:200] or None
    return [Flag(o[2:], takes, ch, dep, note, optional) for o in options if o.startswith("--")]


def _literal(node: ast.AST | None, constants: dict[str, Any]) -> Any:
    """A literal value, or a module-level constant it names; None when not literal."""
    if node is None:
        return None
    if isinstance(node, ast.Name):
        return constants.get(node.id)
    if isinstance(node, ast.JoinedStr):  # f-strings: keep the literal parts (enough to see "Deprecated")
        return "".join(v.value for v in node.values if isinstance(v, ast.Constant) and isinstance(v.value, str))
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _literal(node.left, constants), _literal(node.right, constants)
        return left + right if isinstance(left, str) and isinstance(right, str) else None
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError):
        return None


def _module_constants(tree: ast.Module) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            value = _literal(node.value, out)
            if value is not None:
                out[node.targets[0].id] = value
    return out


def _find_function(tree: ast.Module, cls: str, function: str) -> ast.FunctionDef | None:
    scope: Iterable[ast.AST] = tree.body
    if cls:
        klass = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls), None)
        if klass is None:
            return None
        scope = klass.body
    return next((n for n in scope if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == function), None)


_NO_VALUE_ACTIONS = {"store_true", "store_false", "store_const", "count", "help", "version", "append_const"}


def flags_from_argparse_source(text: str, cls: str, function: str) -> list[Flag]:
    """Flags of the `add_argument` calls in `cls.function` of a module's source, read with `ast`:
    option strings that are literals, `action`, `nargs`, `choices`, `deprecated` and `help` where
    literal (or a module constant). Calls whose option names are computed are not seen."""
    tree = ast.parse(text)
    fn = _find_function(tree, cls, function)
    if fn is None:
        raise LookupError(f"no {cls + '.' if cls else ''}{function} in the source")
    constants = _module_constants(tree)
    out: list[Flag] = []
    for node in ast.walk(fn):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument"):
            continue
        options = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        if not any(o.startswith("--") for o in options):
            continue
        kw = {k.arg: k.value for k in node.keywords if k.arg}
        action = kw.get("action")
        action_name = (_literal(action, constants) if isinstance(action, ast.Constant) else
                       action.attr if isinstance(action, ast.Attribute) else
                       action.id if isinstance(action, ast.Name) else "") or ""
        nargs = _literal(kw.get("nargs"), constants)
        switch = action_name in _NO_VALUE_ACTIONS or "BooleanOptional" in action_name
        if switch or (action_name.startswith("Deprecated") and "StoreTrue" in action_name):
            nargs = 0
        if "BooleanOptional" in action_name:
            options = options + [f"--no-{o[2:]}" for o in options if o.startswith("--")]
        out += flag_from_action(options, nargs=nargs, choices=_literal(kw.get("choices"), constants),
                                action_class=action_name, deprecated_attr=_literal(kw.get("deprecated"), constants),
                                help_text=_literal(kw.get("help"), constants))
    return out


def flags_from_click_source(text: str, function: str) -> list[Flag]:
    """Flags of the `@click.option(...)` decorators of `function` (TensorRT-LLM's `serve`)."""
    tree = ast.parse(text)
    fn = _find_function(tree, "", function)
    if fn is None:
        raise LookupError(f"no {function} in the source")
    constants = _module_constants(tree)
    out: list[Flag] = []
    for dec in fn.decorator_list:
        if not (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute) and dec.func.attr == "option"):
            continue
        options = [a.value for a in dec.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        kw = {k.arg: k.value for k in dec.keywords if k.arg}
        is_flag = _literal(kw.get("is_flag"), constants) is True or _literal(kw.get("count"), constants) is True
        choices = None
        t = kw.get("type")
        if isinstance(t, ast.Call) and isinstance(t.func, ast.Attribute) and t.func.attr == "Choice" and t.args:
            choices = _literal(t.args[0], constants)
        words = [w for o in options for w in o.split("/")]  # click's --x/--no-x
        out += flag_from_action(words, nargs=0 if is_flag or len(words) > len(options) else None, choices=choices,
                                action_class="", deprecated_attr=_literal(kw.get("deprecated"), constants),
                                help_text=_literal(kw.get("help"), constants))
    return out


def _is_literal(node: ast.AST) -> bool:
    """`Literal`, `typing.Literal` or `typing_extensions.Literal`."""
    return ((isinstance(node, ast.Name) and node.id == "Literal")
            or (isinstance(node, ast.Attribute) and node.attr == "Literal"))


def _strings(node: ast.AST) -> list[str] | None:
    """The strings of `Literal["a", "b"]` or of a list/tuple literal `["a", "b"]`; None for anything else
    (a Literal that names another alias, a computed list)."""
    if isinstance(node, ast.Subscript) and _is_literal(node.value):
        node = node.slice
        items = node.elts if isinstance(node, ast.Tuple) else [node]  # Literal["only"]
    elif isinstance(node, (ast.List, ast.Tuple)):
        items = node.elts
    else:
        return None
    if not items or not all(isinstance(i, ast.Constant) and isinstance(i.value, str) for i in items):
        return None
    return [i.value for i in items]  # type: ignore[attr-defined]


def choices_from_source(text: str, symbol: str) -> list[str]:
    """The values a module-level `symbol` lists, read with `ast` (nothing is imported), in source order:
    `X = Literal["a", ...]`, `X: TypeAlias = Literal[...]`, `type X = Literal[...]`, or `X = ["a", ...]`
    / a tuple of strings (annotated or not). LookupError when the module has no such assignment or its
    value is not one of those literals; the last assignment at module level wins, as at import."""
    found: list[str] | None = None
    seen = False
    for node in ast.parse(text).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == symbol for t in node.targets):
            value: ast.AST | None = node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == symbol:
            value = node.value
        elif type(node).__name__ == "TypeAlias" and getattr(node.name, "id", None) == symbol:  # 3.12: `type X = ...`
            value = node.value  # type: ignore[attr-defined]
        else:
            continue
        seen = True
        found = _strings(value) if value is not None else None
    if found is None:
        raise LookupError(f"{symbol} is {'not a literal list of strings' if seen else 'not assigned at module level'}")
    return found


def add_source_choices(flags: dict[str, Flag], engine: str, unpacked: Path) -> list[str]:
    """Give the flags that AFTER_PARSING names for `engine`, and whose parser has no choices, the values
    their release's source lists, with where they came from; returns one line per flag for stderr."""
    report = []
    for name, places in AFTER_PARSING.get(engine, {}).items():
        flag = flags.get(name)
        if flag is None or not flag.takes_value:
            report.append(f"note: --{name} is not a flag taking a value in this release")
            continue
        if flag.choices:
            report.append(f"--{name}: argparse choices kept ({len(flag.choices)})")
            continue
        for path, symbol in places:
            file = unpacked / path
            if not file.exists():
                continue
            try:
                flag.choices = choices_from_source(file.read_text(), symbol)
            except LookupError as e:
                report.append(f"note: {path}: {e}")
                continue
            flag.choices_source = f"{path} {symbol}"
            report.append(f"--{name}: {len(flag.choices)} choices from {flag.choices_source}")
            break
        else:
            report.append(f"warning: --{name}: none of {[f'{p} {s}' for p, s in places]} lists its values; no choices")
    return report


def merge(flags: Iterable[Flag]) -> dict[str, Flag]:
    """By name, first definition wins (argparse refuses a second one anyway), sorted."""
    out: dict[str, Flag] = {}
    for f in flags:
        out.setdefault(f.name, f)
    return dict(sorted(out.items()))


def render(engine: str, version: str, flags: dict[str, Flag], *, wheel: str, sha256: str, mode: str,
           date: str, how: str, present: Iterable[str] | None = None) -> str:
    """The flag file's text: a header saying how it was made, then YAML that `flag_table` reads."""
    import yaml

    e = ENGINES[engine]
    n_dep = sum(f.deprecated for f in flags.values())
    header = [
        f"Flags of `{e.command}` in {engine} {version}, dumped from its own parser by tools/dump_engine_flags.py",
        f"({how}). Regenerate, do not edit: python tools/dump_engine_flags.py {engine} {version}",
        f"Source: the wheel {wheel} from PyPI, sha256 {sha256}.",
        f"{len(flags)} long options, {n_dep} marked deprecated. takes_value: false for switches (store_true,",
        "BooleanOptionalAction: both --x and --no-x are keys); optional_value: the flag alone or with a value (nargs='?');",
        "choices as argparse enforces them; short aliases are not keys. argparse also accepts unambiguous prefixes",
        "of a flag, which are not flags the source defines and are not listed.",
    ]
    if any(f.choices_source for f in flags.values()):
        header += ["choices_source: the engine checks that flag's value after parsing, not argparse; its choices are "
                   "the", "values that symbol of that file in the same wheel lists (read with ast)."]
    data = {
        "tool": engine, "command": e.command, "version": version, "date": date,
        "sources": [f"https://pypi.org/project/{e.package}/{version}/",
                    *(f"https://github.com/{_REPOS[engine]}/blob/v{version}/{_REPO_PATH[engine]}{s}" for s in e.sources
                      if present is None or s in present)],
        "wheel": {"name": wheel, "sha256": sha256},
        "generated_by": f"tools/dump_engine_flags.py --mode {mode}",
        "flags": {name: f.as_yaml() for name, f in flags.items()},
    }
    body = yaml.safe_dump(data, sort_keys=False, default_flow_style=None, width=120)
    return "".join(f"# {h}\n" for h in header) + body


_REPOS = {"vllm": "vllm-project/vllm", "sglang": "sgl-project/sglang", "trtllm": "NVIDIA/TensorRT-LLM"}
_REPO_PATH = {"vllm": "", "sglang": "python/", "trtllm": ""}


# ----- the parts that need the network and a scratch folder ------------------------------

def download(engine: str, version: str, scratch: Path) -> Path:
    e = ENGINES[engine]
    dest = scratch / "wheels"
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--index-url", INDEX,
                    "-d", str(dest), f"{e.package}=={version}"], check=True)
    wheels = sorted(dest.glob(f"{e.top}-{version}-*.whl"))
    if not wheels:
        raise SystemExit(f"error: no {e.package} {version} wheel on PyPI (only an sdist or a stub?)")
    return wheels[0]


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def unpack(wheel: Path, dest: Path, top: str) -> Path:
    """The package's Python files and data (no compiled extensions) under dest."""
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            if (name.startswith(f"{top}/") and not name.endswith((".so", ".pyd", ".cubin"))) or ".dist-info/" in name:
                z.extract(name, dest)
    return dest


def light_requirements(unpacked: Path) -> list[str]:
    """The wheel's own Requires-Dist for this platform, without extras and GPU-only packages."""
    from packaging.markers import default_environment
    from packaging.requirements import Requirement

    meta = next(unpacked.glob("*.dist-info/METADATA")).read_text()
    env = default_environment()
    out = []
    for line in meta.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is not None and not req.marker.evaluate({**env, "extra": ""}):
            continue
        if GPU_ONLY.match(req.name):
            continue
        out.append(f"{req.name}{''.join(f'[{x}]' for x in [','.join(sorted(req.extras))] if x)}")
    return out


def scratch_venv(scratch: Path) -> Path:
    """A venv that also sees this interpreter's site-packages (torch for CPU, when installed)."""
    venv = scratch / "venv"
    py = venv / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        import site
        own = subprocess.run([str(py), "-c", "import site; print(site.getsitepackages()[0])"], check=True,
                             capture_output=True, text=True).stdout.strip()
        Path(own, "_host_site.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return py


_DUMPER = r'''
import argparse, json, sys, types
engine = sys.argv[1]
if engine == "vllm":
    sys.modules.setdefault("mkdocs", types.ModuleType("mkdocs"))  # field help texts on, as for --help
    import vllm.platforms as platforms  # the CPU platform (0.11 has no VLLM_TARGET_DEVICE switch for it)
    if getattr(platforms, "_current_platform", None) is None:
        from vllm.platforms.cpu import CpuPlatform
        platforms._current_platform = CpuPlatform()
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:
        from vllm.utils import FlexibleArgumentParser
    try:
        from vllm.entrypoints.common.cli_args import make_arg_parser
    except ImportError:
        from vllm.entrypoints.openai.cli_args import make_arg_parser
    parser = make_arg_parser(FlexibleArgumentParser())
elif engine == "sglang":
    from sglang.srt.server_args import ServerArgs
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
out = []
for a in parser._actions:
    ch = a.choices
    ch = sorted(ch, key=str) if isinstance(ch, (set, frozenset)) else list(ch) if ch is not None and not isinstance(ch, str) else None
    ch = [c for c in ch if isinstance(c, (str, int, float))] if ch is not None else None
    out.append({"options": list(a.option_strings), "nargs": a.nargs, "choices": ch, "class": type(a).__name__,
                "deprecated": getattr(a, "deprecated", False) is True, "help": a.help if isinstance(a.help, str) else None})
print("\n@@FLAGS@@" + json.dumps(out))
'''


def dump_by_import(engine: str, unpacked: Path, scratch: Path) -> list[Flag]:
    py = scratch_venv(scratch)
    reqs = light_requirements(unpacked)
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--index-url", INDEX, *reqs], check=True)
    env = {**os.environ, "PYTHONPATH": str(unpacked), "VLLM_TARGET_DEVICE": "cpu"}
    for _ in range(MAX_MISSING_INSTALLS):
        res = subprocess.run([str(py), "-c", _DUMPER, engine], env=env, capture_output=True, text=True, cwd=scratch)
        if res.returncode == 0 and "@@FLAGS@@" in res.stdout:
            actions = json.loads(res.stdout.split("@@FLAGS@@", 1)[1])
            return [f for a in actions for f in flag_from_action(
                a["options"], nargs=0 if a["nargs"] == 0 else a["nargs"], choices=a["choices"], action_class=a["class"],
                deprecated_attr=a["deprecated"], help_text=a["help"])]
        missing = re.search(r"No module named '([^'.]+)", res.stderr)
        if not missing or missing.group(1) == ENGINES[engine].top:
            raise RuntimeError(f"building {engine}'s parser failed:\n{res.stderr[-3000:]}")
        name = {"zmq": "pyzmq", "cv2": "opencv-python-headless", "PIL": "pillow", "yaml": "pyyaml",
                "cpuinfo": "py-cpuinfo", "google": "protobuf"}.get(missing.group(1), missing.group(1))
        print(f"installing {name} (imported by {engine}, not in its requirements for this platform)", file=sys.stderr)
        subprocess.run([str(py), "-m", "pip", "install", "-q", "--index-url", INDEX, name], check=True)
    raise RuntimeError(f"{engine}'s parser still misses modules after {MAX_MISSING_INSTALLS} installs")


def dump_by_ast(engine: str, unpacked: Path) -> list[Flag]:
    e = ENGINES[engine]
    out: list[Flag] = []
    for src, (cls, fn) in zip(e.sources, e.methods):
        path = unpacked / src
        if not path.exists():
            print(f"note: {src} is not in this release", file=sys.stderr)
            continue
        text = path.read_text()
        out += flags_from_click_source(text, fn) if engine == "trtllm" else flags_from_argparse_source(text, cls, fn)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("engine", choices=sorted(ENGINES))
    p.add_argument("version")
    p.add_argument("--scratch", type=Path, default=None, help="work folder (default: /tmp/shardplan-flags-<engine>-<version>)")
    p.add_argument("--mode", choices=["import", "ast"], default="import")
    p.add_argument("--out", type=Path, default=None, help="default: shardplan/exporters/flags/<engine>-<version>.yaml")
    args = p.parse_args(argv)
    scratch = args.scratch or Path(f"/tmp/shardplan-flags-{args.engine}-{args.version}")
    wheel = download(args.engine, args.version, scratch)
    unpacked = unpack(wheel, scratch / f"src-{args.version}", ENGINES[args.engine].top)
    if args.mode == "import":
        flags = dump_by_import(args.engine, unpacked, scratch)
        how = "the parser built by importing the release's Python sources on CPU"
    else:
        flags = dump_by_ast(args.engine, unpacked)
        how = "add_argument calls read with ast: computed option names are missed"
    table = merge(flags)
    for line in add_source_choices(table, args.engine, unpacked):
        print(line, file=sys.stderr)
    out = args.out or FLAGS_DIR / f"{args.engine}-{args.version}.yaml"
    out.write_text(render(args.engine, args.version, table, wheel=wheel.name, sha256=sha256_of(wheel), mode=args.mode,
                          date=_dt.date.today().isoformat(), how=how,
                          present=[s for s in ENGINES[args.engine].sources if (unpacked / s).exists()]))
    print(f"{out}: {len(table)} flags, {sum(f.deprecated for f in table.values())} deprecated", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
