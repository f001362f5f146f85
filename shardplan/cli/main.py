"""The console entry point: registers every command group, then maps ShardplanError to one
line and its exit code (the single error -> exit-code map)."""

from __future__ import annotations

import atexit
import copy
import gc
import os
import sys
import traceback
from typing import Any

# pydantic looks for plugins in every installed distribution's entry points the first time it
# builds a model (a few ms here, tens in a large ML environment); the command line uses none.
# A value the user set stays.
os.environ.setdefault("PYDANTIC_DISABLE_PLUGINS", "__all__")

try:  # newer typer carries its own copy of click
    from typer._click.exceptions import ClickException
    from typer.exceptions import Abort
except ImportError:  # older typer runs on click itself
    from click.exceptions import Abort, ClickException  # type: ignore[no-redef,assignment]

from typer.main import get_command_name

from shardplan.cli import render_common
from shardplan.errors import EXIT_INTERNAL, ShardplanError

from shardplan.cli.app import app
from shardplan.cli import cmd_catalog, cmd_plan, cmd_capacity, cmd_deploy, cmd_validate, cmd_verify, cmd_watch  # noqa: F401 - they register commands

# At exit the interpreter runs the cycle collector over every object a command made (a large
# search's caches: a quarter of a second) only to free memory the process is about to give
# back. Freezing them first skips that; buffered streams are still flushed and files the
# commands write are closed when written.
atexit.register(gc.freeze)


def _subcommand_path(ctx: Any) -> str:
    """The subcommands under the root, as typed ("estimate", "verify run"): the root's own name is
    how it was started (`shardplan`, `python -m shardplan`), which the hint spells as `shardplan`."""
    names = []
    while ctx is not None and ctx.parent is not None:
        names.append(ctx.info_name)
        ctx = ctx.parent
    return " ".join(reversed(names))


def main() -> None:
    """Console entry point: maps ShardplanError to one line and its exit code.

    A command runs for a second or so and the process then exits, so the cycle collector is off
    while it runs: its passes over the objects the imports and a search make (reference counting
    frees the short-lived ones) cost 0.05-0.1 s of a command and free nothing that matters. When
    it ends, what the command made is frozen (`gc.freeze`) before the collector is turned back
    on, so that it is not walked either; a process that goes on after `main()` (a test calling
    it) can `gc.unfreeze()`. `watch`, which runs until stopped, turns the collector back on."""
    debug = os.environ.get("SHARDPLAN_DEBUG") == "1"
    was_on = gc.isenabled()
    gc.disable()
    try:
        _run(debug)
    finally:
        if was_on and not gc.isenabled():
            gc.freeze()
            gc.enable()


def _app_for(argv: list[str]) -> Any:
    """The application to run `argv` with: where its first word names one of the top-level
    commands, the application with that command alone (and the root's options). Typer turns
    every registered command into a click command on each run, reading each function's
    signature and type hints (about 0.07 s here); the command asked for is built the same way,
    so its options, help and errors are those of the whole application. Anything else (the root's
    help or options, a group, a mistyped name) runs the whole application."""
    word = argv[1] if len(argv) > 1 else ""
    if not word or word.startswith("-"):
        return app
    chosen = [c for c in app.registered_commands
              if (c.name or get_command_name(c.callback.__name__ if c.callback else "")) == word]
    if len(chosen) != 1:
        return app
    alone = copy.copy(app)
    alone.registered_commands = chosen
    alone.registered_groups = []
    return alone


def _run(debug: bool) -> None:
    try:
        code = _app_for(sys.argv)(standalone_mode=False)
    except ClickException as e:
        # A bad option value or usage: one line, as every other input error (not click's box).
        sub = _subcommand_path(getattr(e, "ctx", None))
        where = f" (fix: see 'shardplan {sub} --help')" if sub else ""
        render_common.error_line(" ".join(f"{e.format_message()}{where}".split()))
        sys.exit(e.exit_code)
    except Abort:
        render_common.error_line("interrupted")
        sys.exit(130)
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
    sys.exit(code if isinstance(code, int) else 0)


__all__ = ["app", "main"]
