"""The console entry point: registers every command group, then maps ShardplanError to one
line and its exit code (the single error -> exit-code map)."""

from __future__ import annotations

import os
import sys
import traceback



from shardplan.cli import render_common
from shardplan.errors import EXIT_INTERNAL, ShardplanError

from shardplan.cli.app import app
from shardplan.cli import cmd_catalog, cmd_plan, cmd_capacity, cmd_deploy, cmd_validate, cmd_verify  # noqa: F401 - they register commands


def main() -> None:
    """Console entry point: maps ShardplanError to one line and its exit code."""
    debug = os.environ.get("SHARDPLAN_DEBUG") == "1"
    try:
        app(standalone_mode=True)
    except ShardplanError as e:
        if debug:
            traceback.print_exc()
        render_common.error_line(e.one_line())
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        render_common.error_line("interrupted")
        sys.exit(130)
    except Exception as e:  # noqa: BLE001 - the last line of defence: no raw traceback for users
        if debug:
            traceback.print_exc()
        render_common.error_line(
            f"internal error: {type(e).__name__}: {e} (a bug; rerun with SHARDPLAN_DEBUG=1 and report the traceback)"
        )
        sys.exit(EXIT_INTERNAL)


__all__ = ["app", "main"]
