"""What a command loads before it searches (issue 25: `shardplan --help` within 0.3 s, every
search within a second, start-up included): `--help` loads no schema, task, exporter or spec;
`recommend --json` no renderer (rich), plot, exporter or verify module. Checked on the imports
a fresh process makes (`python -X importtime`), not on timings, which vary by machine."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO


def _imported(*args: str) -> set[str]:
    """The modules a fresh `python -m shardplan ARGS` process imports."""
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "shardplan", *args], capture_output=True,
                         text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return {line.rsplit("|", 1)[1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}


def _under(modules: set[str], *prefixes: str) -> list[str]:
    return sorted(m for m in modules if any(m == p or m.startswith(p + ".") for p in prefixes))


def test_help_loads_no_schema_task_exporter_or_spec():
    modules = _imported("--help")
    assert "shardplan.cli.cmd_plan" in modules  # the commands are registered ...
    heavy = ("pydantic", "yaml", "shardplan.specs", "shardplan.tasks", "shardplan.exporters", "shardplan.search",
             "shardplan.plan", "shardplan.knowledge", "shardplan.verify", "shardplan.cost.estimate")
    assert _under(modules, *heavy) == []  # ... from light modules only


def test_recommend_json_loads_no_renderer_plot_exporter_or_verify():
    modules = _imported("recommend", "llama-3.2-1b", "--gpus", "1", "--json")
    assert "shardplan.search.serving" in modules
    assert _under(modules, "rich", "matplotlib", "shardplan.exporters", "shardplan.verify", "shardplan.cli.plots",
                  "shardplan.cli.render_plan") == []


def test_the_command_lines_export_targets_are_the_exporters():
    """cli/options.py names the export targets itself, so that defining the options does not
    import the exporters: the two lists must stay the same."""
    from shardplan.cli.options import TARGET_NAMES
    from shardplan.exporters import TARGETS

    assert TARGET_NAMES == list(TARGETS)


def test_schema_outputs_resolve_to_result_models():
    """cli/schemas.py names where each output's model lives; each name must import."""
    from pydantic import BaseModel

    from shardplan.cli.schemas import OUTPUTS, output_model

    for name in OUTPUTS:
        model = output_model(name)
        assert isinstance(model, type) and issubclass(model, BaseModel), name
    assert output_model("nope") is None
