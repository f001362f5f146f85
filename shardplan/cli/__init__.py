"""The command line: a thin typer layer over `shardplan.tasks`.

Rules (held by tests/test_architecture.py): only this package imports typer and rich's
console; nothing else under `shardplan/` imports `shardplan.cli`. Commands parse options,
call one task, and hand its typed result to a renderer (`render_*.py`) or to `--json`.
"""

from shardplan.cli.main import app, main

__all__ = ["app", "main"]
