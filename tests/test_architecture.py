"""The lines the layout draws (STYLE.md, "A layout that shows the architecture"), read from the
source with `ast`: who may import torch, yaml, rich, typer and `cli`; which way data flows
between the packages; that tasks neither print nor import each other; that no import circle
forms. Imports at module level and inside functions both count, except for the circle check,
which follows what runs at import time.

Every checker takes the package directory, so the `*_can_fail` tests run it on a tiny package
written into tmp_path with one violation in it and see it reported."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from conftest import REPO

PKG = REPO / "shardplan"

# The modules that run inside a rank under torchrun: they build the model, shard it and measure it;
# and offload_serving.py, which loads an offloaded serving plan with accelerate in one process
# (`verify --checkpoint`; the CLI imports it only then).
TORCH_MODULES = {"worker.py", "model.py", "parallel.py", "measure.py", "probes.py", "context.py", "experts.py",
                 "offload_serving.py", "cpu_matmul.py"}
# launch.py counts GPUs with torch, inside a function, so that planning never loads it.
TORCH_IN_FUNCTIONS_ONLY = {"launch.py"}
# specs/hf_meta.py builds a model_type shardplan cannot translate with transformers on the meta
# device, importing torch inside that one function, so that loading any other model never does.
SPECS_TORCH_IN_FUNCTIONS_ONLY = {"specs/hf_meta.py"}

# The pure core: no file formats, no terminal.
NO_IO_LIBS = ("cost/", "search/", "plan/schema.py", "plan/readback.py", "knowledge/schema.py")
IO_LIBS = ("yaml", "rich", "typer")

# Data flows specs -> cost -> search -> plan -> exporters; tasks compose them; cli renders.
# knowledge (engine rules as data) sits beside specs: the cost model's inputs are resolved from it.
# validation (the measured cases run through the cost model: `shardplan validate`, the bands) reads
# plans (a verify report's or a calibration's) and is read by tasks.
LAYERS = ("specs", "knowledge", "cost", "search", "plan", "validation", "exporters", "tasks", "verify", "cli")
FORBIDDEN = {
    "specs": {"knowledge", "cost", "search", "plan", "validation", "exporters", "tasks", "verify", "cli"},
    "knowledge": {"cost", "search", "plan", "validation", "exporters", "tasks", "verify", "cli"},
    "cost": {"search", "plan", "validation", "exporters", "tasks", "verify", "cli"},
    "search": {"plan", "validation", "exporters", "tasks", "verify", "cli"},
    "plan": {"validation", "exporters", "tasks", "verify", "cli"},
    "validation": {"exporters", "tasks", "verify", "cli"},
    "exporters": {"validation", "tasks", "verify", "cli"},
}

MAX_TOP_MODULES = 3  # errors, units, fileio: the ground every package stands on
# `python -m shardplan` is an entry point like [project.scripts]: it starts the CLI, nothing imports it.
ENTRY_POINTS = {"__main__.py"}


@dataclass(frozen=True)
class Import:
    file: str  # relative to the package's parent, e.g. "shardplan/cost/params.py"
    line: int
    module: str  # absolute dotted name; for `from m import n`, "m.n" when n is a submodule, else "m"
    in_function: bool
    type_checking: bool  # under `if TYPE_CHECKING:`: never runs

    def __str__(self) -> str:
        return f"{self.file}:{self.line} imports {self.module}"


def _module_name(pkg: Path, path: Path) -> str:
    parts = path.relative_to(pkg.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _resolve_relative(pkg: Path, path: Path, level: int, module: str | None) -> str:
    base = _module_name(pkg, path).split(".")
    if not _is_package(path):
        base = base[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join(base + ([module] if module else []))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_of(pkg: Path, path: Path) -> list[Import]:
    return _imports_of(pkg, path, path.stat().st_mtime_ns)


@lru_cache(maxsize=None)
def _parse(path: Path, mtime_ns: int) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


@lru_cache(maxsize=None)
def _imports_of(pkg: Path, path: Path, mtime_ns: int) -> list[Import]:
    """Every import in one file: `import a.b` gives a.b; `from a import b` gives a.b when b is a
    module of the package, else a (b is defined in a, which must have run first);
    `importlib.import_module("a.b")` with a string literal gives a.b."""
    rel = str(path.relative_to(pkg.parent))
    found: list[Import] = []

    def visit(node: ast.AST, in_function: bool, type_checking: bool) -> None:
        if isinstance(node, ast.Import):
            for a in node.names:
                found.append(Import(rel, node.lineno, a.name, in_function, type_checking))
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_relative(pkg, path, node.level, node.module) if node.level else (node.module or "")
            submodules = [f"{base}.{a.name}" for a in node.names if a.name != "*" and _is_module(pkg, f"{base}.{a.name}")]
            if len(submodules) < len(node.names):  # a name defined in `base` itself: base runs first
                found.append(Import(rel, node.lineno, base, in_function, type_checking))
            found.extend(Import(rel, node.lineno, m, in_function, type_checking) for m in submodules)
        elif isinstance(node, ast.Call) and _is_import_module(node.func) and node.args \
                and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            found.append(Import(rel, node.lineno, node.args[0].value, in_function, type_checking))
        nested = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, nested, True)
            for child in node.orelse:
                visit(child, nested, type_checking)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, nested, type_checking)

    visit(_parse(path, mtime_ns), False, False)
    return found


def _is_module(pkg: Path, dotted: str) -> bool:
    parts = dotted.split(".")
    if parts[0] != pkg.name:
        return False
    where = pkg.parent.joinpath(*parts)
    return where.with_suffix(".py").is_file() or (where / "__init__.py").is_file()


def _is_import_module(func: ast.expr) -> bool:
    return (isinstance(func, ast.Attribute) and func.attr == "import_module") or \
        (isinstance(func, ast.Name) and func.id == "import_module")


def _files(pkg: Path) -> list[Path]:
    return sorted(p for p in pkg.rglob("*.py") if "__pycache__" not in p.parts)


def _rel(pkg: Path, path: Path) -> str:
    return path.relative_to(pkg).as_posix()


def _top(module: str) -> str:
    return module.split(".")[0]


def _imports_library(imp: Import, library: str) -> bool:
    return imp.module == library or imp.module.startswith(library + ".")


# ----- the checkers: each returns the violations as sentences -------------------------------------

def check_torch(pkg: Path) -> list[str]:
    bad = []
    for path in _files(pkg):
        rel = _rel(pkg, path)
        in_verify = rel.startswith("verify/")
        for imp in imports_of(pkg, path):
            if not _imports_library(imp, "torch"):
                continue
            if in_verify and path.name in TORCH_MODULES:
                continue
            if in_verify and path.name in TORCH_IN_FUNCTIONS_ONLY and imp.in_function:
                continue
            if rel in SPECS_TORCH_IN_FUNCTIONS_ONLY and imp.in_function:
                continue
            where = "at module level (import it inside the function that needs it)" \
                if in_verify and path.name in TORCH_IN_FUNCTIONS_ONLY else \
                "(only the verify modules that run in a rank may import torch)"
            bad.append(f"{imp} {where}")
    return bad


def check_pure_core_has_no_io_libraries(pkg: Path) -> list[str]:
    bad = []
    for path in _files(pkg):
        rel = _rel(pkg, path)
        if not any(rel == p or (p.endswith("/") and rel.startswith(p)) for p in NO_IO_LIBS):
            continue
        bad += [f"{imp} (cost, search, plan/schema and plan/readback import no {', '.join(IO_LIBS)})"
                for imp in imports_of(pkg, path) if any(_imports_library(imp, lib) for lib in IO_LIBS)]
    return bad


def check_nothing_imports_cli(pkg: Path) -> list[str]:
    bad = []
    cli = f"{pkg.name}.cli"
    for path in _files(pkg):
        rel = _rel(pkg, path)
        if rel.startswith("cli/") or rel in ENTRY_POINTS:
            continue
        for imp in imports_of(pkg, path):
            if _imports_library(imp, cli):
                bad.append(f"{imp} (nothing outside cli/ imports the CLI)")
            elif _imports_library(imp, "typer") or _imports_library(imp, "rich"):
                bad.append(f"{imp} (only cli/ talks to the terminal)")
    return bad


def check_tasks_do_not_print(pkg: Path) -> list[str]:
    bad = []
    for path in sorted((pkg / "tasks").glob("*.py")):
        rel = str(path.relative_to(pkg.parent))
        for node in ast.walk(_parse(path, path.stat().st_mtime_ns)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
                bad.append(f"{rel}:{node.lineno} calls print() (a task returns its result; the CLI renders it)")
            elif isinstance(node, ast.Attribute) and node.attr in ("stdout", "stderr", "__stdout__", "__stderr__") \
                    and isinstance(node.value, ast.Name) and node.value.id == "sys":
                bad.append(f"{rel}:{node.lineno} uses sys.{node.attr} (a task writes to no terminal)")
            elif isinstance(node, ast.ImportFrom) and node.module == "sys" \
                    and any(a.name in ("stdout", "stderr") for a in node.names):
                bad.append(f"{rel}:{node.lineno} imports sys.stdout/stderr (a task writes to no terminal)")
            elif isinstance(node, ast.Name) and node.id == "Console":
                bad.append(f"{rel}:{node.lineno} uses a rich Console (a task writes to no terminal)")
        bad += [f"{imp} (a task writes to no terminal)" for imp in imports_of(pkg, path)
                if _imports_library(imp, "rich")]
    return bad


def check_tasks_do_not_import_tasks(pkg: Path) -> list[str]:
    bad = []
    tasks = f"{pkg.name}.tasks"
    for path in sorted((pkg / "tasks").glob("*.py")):
        if path.name == "__init__.py" or path.name.startswith("_"):
            continue
        own = f"{tasks}.{path.stem}"
        for imp in imports_of(pkg, path):
            if not imp.module.startswith(tasks + "."):
                continue
            name = imp.module[len(tasks) + 1:].split(".")[0]
            if imp.module.startswith(own) or name.startswith("_"):
                continue  # itself, or a shared private helper module (tasks/_*.py)
            if (pkg / "tasks" / f"{name}.py").is_file() or (pkg / "tasks" / name).is_dir():
                bad.append(f"{imp} (tasks do not import each other; share code through tasks/_*.py or a lower layer)")
    return bad


def check_flow_direction(pkg: Path) -> list[str]:
    bad = []
    seen: set[tuple[str, int, str]] = set()
    for path in _files(pkg):
        layer = _rel(pkg, path).split("/")[0]
        if layer not in FORBIDDEN:
            continue
        for imp in imports_of(pkg, path):
            parts = imp.module.split(".")
            if parts[0] == pkg.name and len(parts) > 1 and parts[1] in FORBIDDEN[layer] \
                    and (imp.file, imp.line, parts[1]) not in seen:
                seen.add((imp.file, imp.line, parts[1]))
                bad.append(f"{imp} ({layer} comes before {parts[1]}: data flows "
                           f"specs -> cost -> search -> plan -> exporters)")
    return bad


def import_graph(pkg: Path) -> dict[str, set[str]]:
    """Module -> the package modules it imports when it is loaded (function bodies and
    TYPE_CHECKING blocks left out; `from p import m` counts m when m is a module)."""
    modules = {_module_name(pkg, p): p for p in _files(pkg)}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for imp in imports_of(pkg, path):
            if not imp.in_function and not imp.type_checking and imp.module in modules and imp.module != name:
                graph[name].add(imp.module)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    component.append(m)
                    if m == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def check_no_import_cycles(pkg: Path) -> list[str]:
    graph = import_graph(pkg)
    bad = []
    for cycle in import_cycles(graph):
        edges = [f"{a} -> {b}" for a in cycle for b in sorted(graph[a]) if b in cycle]
        bad.append(f"import circle among {', '.join(cycle)}: {'; '.join(edges)}")
    return bad


def check_top_level_is_small(pkg: Path) -> list[str]:
    top = sorted(p.name for p in pkg.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    if len(top) > MAX_TOP_MODULES:
        return [f"{pkg.name}/ holds {len(top)} modules at its top ({', '.join(top)}); at most {MAX_TOP_MODULES}: "
                "put the rest in the package they belong to"]
    return []


def _report(violations: list[str]) -> str:
    return "\n".join(["", *violations])


# ----- the rules, on the real package ----------------------------------------------------------

def test_only_the_verify_ranks_import_torch():
    violations = check_torch(PKG)
    assert not violations, _report(violations)


def test_the_pure_core_imports_no_yaml_rich_or_typer():
    violations = check_pure_core_has_no_io_libraries(PKG)
    assert not violations, _report(violations)


def test_nothing_outside_cli_imports_cli_typer_or_rich():
    violations = check_nothing_imports_cli(PKG)
    assert not violations, _report(violations)


def test_tasks_never_print():
    violations = check_tasks_do_not_print(PKG)
    assert not violations, _report(violations)


def test_tasks_never_import_another_task():
    violations = check_tasks_do_not_import_tasks(PKG)
    assert not violations, _report(violations)


def test_data_flows_one_way():
    violations = check_flow_direction(PKG)
    assert not violations, _report(violations)


def test_the_pure_core_reads_engine_rules_only_through_the_schema():
    """cost/ and search/ take resolved `EngineRules`; reading the YAML (knowledge.load) is the edge's job."""
    bad = [f"{imp}" for layer in ("cost", "search") for path in _files(PKG / layer)
           for imp in imports_of(PKG, path) if imp.module.startswith("shardplan.knowledge.load")]
    assert not bad, _report(bad)


def test_no_import_circles():
    violations = check_no_import_cycles(PKG)
    assert not violations, _report(violations)


def test_the_top_of_the_package_is_small():
    violations = check_top_level_is_small(PKG)
    assert not violations, _report(violations)


def test_the_checkers_see_the_real_imports():
    """A checker that reads nothing passes everything: the real package's graph has the edges
    it is known to have, and the rank modules' torch imports are found (then allowed)."""
    graph = import_graph(PKG)
    assert "shardplan.verify.runspec" in graph["shardplan.verify.launch"]
    assert "shardplan.verify.worker" in graph["shardplan.verify.session"]  # `from shardplan.verify import worker`
    assert "shardplan.cost.estimate" in graph["shardplan.tasks.recommend"]
    torch_in_worker = [i for i in imports_of(PKG, PKG / "verify" / "worker.py") if _imports_library(i, "torch")]
    assert torch_in_worker
    launch = [i for i in imports_of(PKG, PKG / "verify" / "launch.py") if _imports_library(i, "torch")]
    assert launch and all(i.in_function for i in launch)


# ----- each rule can fail ------------------------------------------------------------------------

def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    pkg = tmp_path / "shardplan"
    for rel in ["__init__.py", *files]:
        path = pkg / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        (path.parent / "__init__.py").touch()
        if rel in files:
            path.write_text(files[rel])
    return pkg


def test_torch_outside_the_ranks_is_caught(tmp_path):
    pkg = _package(tmp_path, {
        "cost/params.py": "import torch\n",
        "verify/compare.py": "def f():\n    from torch import nn\n",
        "verify/launch.py": "import torch.cuda\n",
        "verify/worker.py": "import torch\n",  # allowed
        "verify/other.py": "def count():\n    import torch\n",
    })
    bad = check_torch(pkg)
    assert any("shardplan/cost/params.py:1 imports torch" in b for b in bad)
    assert any("shardplan/verify/compare.py:2 imports torch" in b for b in bad)
    assert any("shardplan/verify/launch.py:1 imports torch.cuda at module level" in b for b in bad)
    assert any("shardplan/verify/other.py" in b for b in bad)
    assert not any("worker.py" in b for b in bad)
    ok = _package(tmp_path / "ok", {"verify/launch.py": "def gpus():\n    import torch\n"})
    assert check_torch(ok) == []


def test_yaml_in_the_pure_core_is_caught(tmp_path):
    pkg = _package(tmp_path, {
        "cost/x.py": "import yaml\n",
        "search/y.py": "def f():\n    from rich.console import Console\n",
        "plan/schema.py": "import typer\n",
        "plan/manifest.py": "import yaml\n",  # allowed: the manifest is written as YAML
    })
    bad = check_pure_core_has_no_io_libraries(pkg)
    assert len(bad) == 3, bad
    assert any("shardplan/cost/x.py:1 imports yaml" in b for b in bad)
    assert any("shardplan/search/y.py:2 imports rich.console" in b for b in bad)
    assert any("shardplan/plan/schema.py:1 imports typer" in b for b in bad)


def test_importing_the_cli_is_caught(tmp_path):
    pkg = _package(tmp_path, {
        "tasks/a.py": "from shardplan.cli import render_plan\n",
        "plan/b.py": "def f():\n    import typer\n",
        "exporters/c.py": "from rich.table import Table\n",
        "cli/app.py": "import typer\nfrom shardplan.cli import options\n",  # allowed
        "__main__.py": "from shardplan.cli import main\n",  # the entry point, allowed
    })
    bad = check_nothing_imports_cli(pkg)
    assert any("shardplan/tasks/a.py:1 imports shardplan.cli" in b for b in bad)
    assert any("shardplan/plan/b.py:2 imports typer" in b for b in bad)
    assert any("shardplan/exporters/c.py:1 imports rich.table" in b for b in bad)
    assert not any("cli/app.py" in b or "__main__" in b for b in bad)


def test_a_task_that_prints_is_caught(tmp_path):
    pkg = _package(tmp_path, {
        "tasks/a.py": "def run():\n    print('done')\n",
        "tasks/b.py": "import sys\n\ndef run():\n    sys.stderr.write('x')\n",
        "tasks/c.py": "from rich.console import Console\n\ndef run():\n    Console().print('x')\n",
        "tasks/d.py": "def run():\n    return 1\n",
    })
    bad = check_tasks_do_not_print(pkg)
    assert any("shardplan/tasks/a.py:2 calls print()" in b for b in bad)
    assert any("shardplan/tasks/b.py:4 uses sys.stderr" in b for b in bad)
    assert any("shardplan/tasks/c.py" in b and "Console" in b for b in bad)
    assert not any("tasks/d.py" in b for b in bad)


def test_a_task_importing_a_task_is_caught(tmp_path):
    pkg = _package(tmp_path, {
        "tasks/a.py": "from shardplan.tasks import b\n",
        "tasks/b.py": "def f():\n    from shardplan.tasks.a import run\n",
        "tasks/c.py": "from shardplan.tasks._shared import helper\nfrom . import _shared\n",  # allowed
        "tasks/_shared.py": "def helper():\n    pass\n",
    })
    bad = check_tasks_do_not_import_tasks(pkg)
    assert any("shardplan/tasks/a.py:1 imports shardplan.tasks.b" in b for b in bad)
    assert any("shardplan/tasks/b.py:2 imports shardplan.tasks.a" in b for b in bad)
    assert not any("tasks/c.py" in b for b in bad), bad


def test_a_backward_import_is_caught(tmp_path):
    pkg = _package(tmp_path, {
        "specs/model.py": "from shardplan.cost.params import count_params\n",
        "cost/params.py": "def f():\n    from shardplan.search import space\n",
        "search/space.py": "from ..plan import schema\n",
        "plan/schema.py": "import shardplan.exporters.base\n",
        "exporters/base.py": "from shardplan.tasks import export\n",
        "tasks/export.py": "from shardplan.exporters import base\n",  # forward: allowed
    })
    bad = check_flow_direction(pkg)
    assert len(bad) == 5, bad
    for needle in ("specs/model.py:1 imports shardplan.cost.params", "cost/params.py:2 imports shardplan.search",
                   "search/space.py:1 imports shardplan.plan", "plan/schema.py:1 imports shardplan.exporters.base",
                   "exporters/base.py:1 imports shardplan.tasks"):
        assert any(needle in b for b in bad), (needle, bad)


def test_an_import_circle_is_caught(tmp_path):
    pkg = _package(tmp_path, {
        "plan/a.py": "from shardplan.plan import b\n",
        "plan/b.py": "from shardplan.plan.a import X\n",
        "cost/c.py": "import importlib\nm = importlib.import_module('shardplan.cost.d')\n",
        "cost/d.py": "from shardplan.cost.e import Y\n",
        "cost/e.py": "from .c import Z\n",
        "search/f.py": "def later():\n    from shardplan.search import g\n",  # in a function: runs later, no circle
        "search/g.py": "from shardplan.search.f import later\n",
    })
    bad = check_no_import_cycles(pkg)
    assert len(bad) == 2, bad
    assert any("shardplan.plan.a, shardplan.plan.b" in b for b in bad)
    assert any("shardplan.cost.c, shardplan.cost.d, shardplan.cost.e" in b for b in bad)


def test_a_crowded_top_is_caught(tmp_path):
    pkg = _package(tmp_path, {f"{n}.py": "" for n in ("errors", "units", "fileio", "helpers", "__main__")})
    bad = check_top_level_is_small(pkg)
    assert bad and "4 modules" in bad[0] and "helpers.py" in bad[0]
    assert check_top_level_is_small(_package(tmp_path / "ok", {"errors.py": "", "units.py": ""})) == []
