"""`--target` (recommend, capacity, replan): the option, and what it implies for the other
options before the workload is built: the target's engine (serving) or stack (training), and
`recommend --export X` implying the target X launches."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from shardplan.cli.options import SEARCH, choice
from shardplan.errors import ShardplanError

# The targets of knowledge/targets.yaml, written out so that defining the option reads no file
# (`shardplan --help` must be quick); tests/search/test_targets.py holds the two lists equal.
TARGET_NAMES = ["vllm", "sglang", "tgi", "trtllm", "llamacpp", "deepspeed", "fsdp", "accelerate", "megatron",
                "torchtitan", "jax"]
TargetOpt = Annotated[Optional[str], typer.Option(
    "--target", metavar="[" + "|".join(TARGET_NAMES) + "]", show_default=False, rich_help_panel=SEARCH,
    help="Search only plans this deployment target runs as they are (knowledge/targets.yaml: what its exporter "
         "writes) and that `shardplan verify` can check; its engine (serving) or stack (training) sizes them. "
         "fsdp: torchrun running shardplan verify's FSDP2 rank program. Without it, each plan lists the targets "
         "that run it (runs_on). E.g. --target tgi: no pipeline stages, shards on one node.",
    callback=choice("--target", TARGET_NAMES, "target"), autocompletion=lambda: TARGET_NAMES)]


def given(ctx: typer.Context, option: str) -> bool:
    """Whether the user gave the option (not its default), on the command line or in the environment."""
    source = ctx.get_parameter_source(option)
    return source is not None and source.name != "DEFAULT"


def engine_and_stack(target: str | None, *, training: bool, engine: str, stack: str | None,
                     engine_given: bool) -> tuple[str, str | None]:
    """The engine and stack a target plans with: its own, unless the user gave another (an error)."""
    if target is None:
        return engine, stack
    from shardplan.knowledge.load import targets_file

    t = targets_file().targets[target]
    if not training and t.engine is not None and engine != t.engine:
        if engine_given:
            raise ShardplanError(f"--target {target} plans with {t.engine}'s rules, not {engine}'s", field="--engine",
                                 hint=f"drop --engine, or give --engine {t.engine}")
        engine = t.engine
    if training and t.stack is not None and stack != t.stack:
        if stack is not None:
            raise ShardplanError(f"--target {target} plans with the {t.stack} stack's rules, not {stack}'s",
                                 field="--stack", hint=f"drop --stack, or give --stack {t.stack}")
        stack = t.stack
    return engine, stack


def with_export(target: str | None, export: str | None, *, training: bool) -> str | None:
    """`recommend --export X` implies the target X launches for the workload; with --target too,
    X must launch it."""
    if export is None:
        return target
    from shardplan.knowledge.load import targets_file

    f = targets_file()
    kind = "training" if training else "inference"
    if target is None:
        implied = f.target_for_export(export, kind)
        if implied is None:
            launches = sorted({x for t in f.targets.values() if kind in t.workloads for x in t.exports})
            raise ShardplanError(f"{export} does not launch {'training' if training else 'serving'} plans",
                                 field="--export", hint=f"export --to one of {', '.join(launches)}")
        return implied
    exports = f.targets[target].exports
    if export not in exports:
        raise ShardplanError(f"{export} does not launch --target {target}'s plans", field="--export",
                             hint=f"export them --to {', '.join(exports)}")
    return target


__all__ = ["TARGET_NAMES", "TargetOpt", "engine_and_stack", "given", "with_export"]
