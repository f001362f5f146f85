"""The typer application, its sub-apps and root options. Commands live in `cmd_*.py` and
register on `app` when `cli.main` imports them."""

from __future__ import annotations

from typing import Annotated

import typer


from shardplan import __version__
from shardplan.errors import EXIT_CODES

EXIT_CODES_HELP = "Exit codes:\n\n" + "\n\n".join(f"  {code}  {meaning}" for code, meaning in EXIT_CODES.items())
CONTEXT = {"help_option_names": ["-h", "--help"]}

app = typer.Typer(
    name="shardplan",
    help="How should I shard this model on this hardware? Per-GPU memory and time for serving "
    "and training layouts (TP, PP, DP/ZeRO, EP, CP).\n\n" + EXIT_CODES_HELP,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=True,  # --install-completion / --show-completion for bash, zsh, fish, PowerShell
    rich_markup_mode="rich",
    context_settings=CONTEXT,
)
models_app = typer.Typer(help="List bundled model specs, or show one (name, config.json, directory or YAML).",
                         context_settings=CONTEXT)
hardware_app = typer.Typer(help="List bundled hardware profiles, or show one (name or YAML path).",
                           context_settings=CONTEXT)
app.add_typer(models_app, name="models")
app.add_typer(hardware_app, name="hardware")

JsonOpt = Annotated[bool, typer.Option("--json", help="Print the result as JSON on stdout.")]


def _version(value: bool) -> None:
    if value:
        typer.echo(f"shardplan {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")] = False,
) -> None:
    pass
