"""`shardplan models` and `shardplan hardware`: the bundled catalogs."""

from __future__ import annotations

from typing import Annotated, Optional

import typer


from shardplan.cli.app import models_app, hardware_app, JsonOpt

# The tasks, the specs and the renderers are imported when a command runs (`shardplan --help`
# loads none of them).


@models_app.callback(invoke_without_command=True)
def models_list(ctx: typer.Context, json_out: JsonOpt = False) -> None:
    """List the bundled model specs with their parameter counts."""
    if ctx.invoked_subcommand is not None:
        return
    from shardplan.cli import render_catalog, render_common
    from shardplan.specs import loading
    from shardplan.tasks.catalog import model_list

    rows = model_list(loading.list_models())
    render_common.emit(rows.model_dump(mode="json") if json_out else rows.root, json_out, render_catalog.models_table)


@models_app.command("show")
def models_show(
    model: Annotated[str, typer.Argument(help="Bundled name (e.g. llama-3.1-70b, any case), config.json, a directory, or a YAML spec.")],
    json_out: JsonOpt = False,
) -> None:
    """Parameter breakdown, total and active counts, KV bytes per token and head/expert facts."""
    from shardplan.cli import render_catalog, render_common
    from shardplan.specs import loading
    from shardplan.tasks.catalog import model_report

    r = model_report(loading.load_model(model))
    render_common.emit(r.model_dump(mode="json") if json_out else r, json_out, render_catalog.model_detail)


@hardware_app.callback(invoke_without_command=True)
def hardware_list(ctx: typer.Context, json_out: JsonOpt = False) -> None:
    """List the bundled hardware profiles."""
    if ctx.invoked_subcommand is not None:
        return
    from shardplan.cli import render_catalog, render_common
    from shardplan.specs import loading
    from shardplan.tasks.catalog import hardware_list as hardware_list_report

    rows = hardware_list_report(loading.list_hardware())
    render_common.emit(rows.model_dump(mode="json") if json_out else rows.root, json_out, render_catalog.hardware_table)


@hardware_app.command("show")
def hardware_show(
    hardware: Annotated[str, typer.Argument(help="Bundled name (e.g. h100-sxm-80gb, any case) or a YAML profile.")],
    gpus_per_node: Annotated[Optional[int], typer.Option(min=1, help="Override GPUs per node.")] = None,
    nodes: Annotated[Optional[int], typer.Option(min=1, help="Number of nodes.")] = None,
    json_out: JsonOpt = False,
) -> None:
    """GPU, node and link figures of one profile, with their sources in --json."""
    from shardplan.cli import render_catalog, render_common
    from shardplan.specs import loading
    from shardplan.specs.cluster import cluster
    from shardplan.tasks.catalog import hardware_report

    hw = cluster(loading.load_hardware(hardware), gpus=None, nodes=nodes, gpus_per_node=gpus_per_node)
    r = hardware_report(hw)
    render_common.emit(r.model_dump(mode="json") if json_out else r, json_out, render_catalog.hardware_detail)
