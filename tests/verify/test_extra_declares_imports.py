"""`pip install shardplan[verify]` brings everything `verify` imports: each third-party module
imported anywhere under shardplan/verify/ (read with `ast`), and the modules torch needs at run
time that our code never names, belongs to a distribution declared in the `verify` extra or in
the base dependencies of pyproject.toml."""

from __future__ import annotations

import ast
import re
import sys
try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, as a package (test extra)
    import tomli as tomllib
from importlib.metadata import packages_distributions

from conftest import REPO

# Modules torch imports on our behalf while a rank runs: no `import` of ours names them.
IMPORTED_INDIRECTLY_AT_RUN_TIME = {
    "numpy": "torch.distributed.gather_object (the ranks' results to rank 0) pickles through numpy: "
             "RuntimeError: Numpy is not available",
}


def third_party_imports(package_dir) -> set[str]:
    """Top-level names of the modules imported (at module level or in functions) by the files
    under `package_dir`, less the standard library and shardplan itself."""
    names: set[str] = set()
    for path in package_dir.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n != "shardplan" and n != "__future__"}


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(requirement: str) -> str:
    return _normalize(re.split(r"[\s\[<>=!~;@]", requirement.strip(), maxsplit=1)[0])


def undeclared(modules: set[str], pyproject: dict) -> list[str]:
    """The modules whose distribution is in neither the base dependencies nor the `verify` extra."""
    project = pyproject["project"]
    declared = {_requirement_name(r) for r in project.get("dependencies", [])}
    declared |= {_requirement_name(r) for r in project.get("optional-dependencies", {}).get("verify", [])}
    dists = packages_distributions()
    missing = []
    for module in sorted(modules):
        candidates = {_normalize(d) for d in dists.get(module, [module])}
        if not candidates & declared:
            missing.append(f"{module} (from {', '.join(sorted(candidates))})")
    return missing


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def test_the_verify_extra_declares_every_module_verify_needs():
    modules = third_party_imports(REPO / "shardplan" / "verify")
    assert "torch" in modules  # the reading works: the rank code imports torch
    modules |= set(IMPORTED_INDIRECTLY_AT_RUN_TIME)
    missing = undeclared(modules, _pyproject())
    assert not missing, f"add to [project.optional-dependencies] verify in pyproject.toml: {missing}"


def test_numpy_is_in_the_verify_extra_itself():
    extra = {_requirement_name(r) for r in _pyproject()["project"]["optional-dependencies"]["verify"]}
    assert "numpy" in extra, IMPORTED_INDIRECTLY_AT_RUN_TIME["numpy"]


def test_an_extra_without_numpy_is_caught():
    pyproject = _pyproject()
    verify = pyproject["project"]["optional-dependencies"]["verify"]
    pyproject["project"]["optional-dependencies"]["verify"] = [r for r in verify if _requirement_name(r) != "numpy"]
    modules = third_party_imports(REPO / "shardplan" / "verify") | set(IMPORTED_INDIRECTLY_AT_RUN_TIME)
    assert any(m.startswith("numpy ") for m in undeclared(modules, pyproject))
    pyproject["project"]["optional-dependencies"]["verify"] = []
    assert any(m.startswith("torch ") for m in undeclared(modules, pyproject))
