"""`validate`: how close shardplan's predictions come to measured runs."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from shardplan.cli.app import JsonOpt, app
from shardplan.cli.options import choice


def _engines() -> list[str]:
    from shardplan.knowledge.load import known_engines

    return known_engines()


def _stacks() -> list[str]:
    from shardplan.knowledge.load import known_stacks

    return known_stacks()


@app.command("validate")
def validate_cmd(
    engine: Annotated[Optional[str], typer.Option(
        help="Only the start-up logs and serving benchmark runs of this engine (vllm, sglang, tgi, trtllm).",
        callback=lambda v: choice("--engine", _engines(), "engine")(v))] = None,
    stack: Annotated[Optional[str], typer.Option(
        help="Only the training and fine-tuning runs of this stack (megatron, torchtitan, deepspeed, hf).",
        callback=lambda v: choice("--stack", _stacks(), "stack")(v))] = None,
    cases: Annotated[Optional[Path], typer.Option(
        help="Your own measured cases (YAML or JSON: `cases:`, see the README) instead of the shipped ones.")] = None,
    cases_table: Annotated[bool, typer.Option("--cases-table/--no-cases-table", help="Also list every case with its error.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """How close the cost model comes to measured runs. Runs every case shardplan ships (engine
    start-up logs, training runs per stack, LoRA/QLoRA peaks, vLLM and SGLang serving benchmark
    runs, each with its source), or your own with --cases, and prints per engine generation or
    stack and per quantity (KV capacity, peak memory, tokens/s, the start-or-refuse verdict; for
    serving runs, by regime, the median TTFT, median TPOT and output tokens/s) the number of cases, the mean, median,
    90th-percentile and largest |error|, and the worst case with its source. The 90th percentile
    is the band that estimate, recommend and capacity print beside their figures. The "layouts"
    row pairs training runs of one setting that differ only in layout and compares the model's
    ratio of their tokens/s with the measured one: its band is how close two plans' step times
    must be for recommend to call them a tie.
    Example: shardplan validate --engine vllm; shardplan validate --cases my-runs.yaml --cases-table"""
    from shardplan.cli import render_common, render_validate
    from shardplan.tasks.validate import validate

    result = validate(engine=engine, stack=stack, cases_file=cases)
    render_common.emit(result.model_dump(mode="json"), json_out,
                       lambda _: render_validate.validate_report(result, cases_table=cases_table))
