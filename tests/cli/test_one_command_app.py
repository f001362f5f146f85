"""The entry point builds only the command asked for (cli/main.py, `_app_for`): typer turns every
registered command into a click command on each run, and one command is all a run needs. What the
user sees must not change: each command's help, and its usage errors, are those of the whole
application; the root's help, its groups and mistyped names run the whole application."""

from __future__ import annotations

import importlib

import pytest
from typer.main import get_command_name

from shardplan.cli.app import app

entry = importlib.import_module("shardplan.cli.main")  # the module (the package exports its `main`)

COMMANDS = sorted(c.name or get_command_name(c.callback.__name__) for c in app.registered_commands)


def test_every_top_level_command_is_found_by_its_name():
    assert {"estimate", "recommend", "capacity", "export", "verify", "watch"} <= set(COMMANDS)
    for name in COMMANDS:
        alone = entry._app_for(["shardplan", name, "--json"])
        assert alone is not app and len(alone.registered_commands) == 1
        assert alone.registered_groups == [] and alone.registered_callback is app.registered_callback
    assert len(app.registered_commands) == len(COMMANDS)  # the whole application is left as it was


@pytest.mark.parametrize("argv", [[], ["--help"], ["--version"], ["models"], ["hardware", "show", "x"],
                                  ["recomend"], ["export-cmd"]])
def test_anything_else_runs_the_whole_application(argv):
    assert entry._app_for(["shardplan", *argv]) is app


@pytest.mark.parametrize("name", COMMANDS)
def test_a_commands_help_is_the_same_as_the_whole_applications(cli, monkeypatch, name):
    alone = cli(name, "--help")
    monkeypatch.setattr(entry, "_app_for", lambda argv: app)
    whole = cli(name, "--help")
    assert alone.exit_code == whole.exit_code == 0
    assert alone.stdout == whole.stdout and name in alone.stdout


def test_a_usage_error_is_the_same_line_and_exit_code(cli, monkeypatch):
    alone = cli("recommend", "llama-3.1-8b", "--no-such-option")
    monkeypatch.setattr(entry, "_app_for", lambda argv: app)
    whole = cli("recommend", "llama-3.1-8b", "--no-such-option")
    assert alone.exit_code == whole.exit_code == 2
    assert alone.stderr == whole.stderr and "--no-such-option" in alone.stderr
