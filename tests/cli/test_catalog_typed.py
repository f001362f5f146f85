"""`models` and `hardware`: names match without regard to case, unknown names suggest the
closest, the tables keep identifiers whole at 80 columns, and the results are typed."""

from __future__ import annotations

import io

import pytest
from pydantic import ValidationError
from rich.console import Console

from shardplan.errors import EXIT_BAD_INPUT, EXIT_OK, UnknownNameError
from shardplan.specs import loading
from shardplan.tasks.catalog import HardwareReport, ModelReport, hardware_list, model_list, model_report


@pytest.mark.parametrize("name", ["Llama-3.1-70B", "LLAMA-3.1-70B", "llama-3.1-70b"])
def test_model_names_are_case_insensitive(cli, name):
    res = cli("models", "show", name, "--json")
    assert res.exit_code == EXIT_OK, res.stderr
    assert res.json()["name"] == "llama-3.1-70b"


def test_hardware_names_are_case_insensitive(cli):
    res = cli("hardware", "show", "H100-SXM-80GB", "--json")
    assert res.exit_code == EXIT_OK, res.stderr
    assert res.json()["name"] == "h100-sxm-80gb"
    assert loading.load_hardware("L4-24GB").name == "l4-24gb"
    assert loading.hardware_path("A100-SXM-80GB").name == "a100-sxm-80gb.yaml"


@pytest.mark.parametrize("args, suggested", [
    (("models", "show", "Llama-3.1-7B"), "llama-3.1-8b"),
    (("hardware", "show", "H100-SXM-80"), "h100-sxm-80gb"),
])
def test_unknown_names_suggest_the_closest_in_catalog_case(cli, args, suggested):
    res = cli(*args)
    assert res.exit_code == EXIT_BAD_INPUT
    assert "did you mean" in res.stderr and suggested in res.stderr


def test_a_name_close_to_nothing_points_at_the_list():
    with pytest.raises(UnknownNameError) as e:
        loading.load_model("zzzzzzzz")
    assert "shardplan models" in str(e.value.hint)


def _render_at_80(monkeypatch, render, rows) -> str:
    from shardplan.cli import render_catalog

    buf = io.StringIO()
    monkeypatch.setattr(render_catalog, "console", Console(file=buf, width=80, force_terminal=False, color_system=None))
    render(rows)
    return buf.getvalue()


def test_tables_keep_every_name_whole_at_80_columns(monkeypatch):
    from shardplan.cli import render_catalog

    models = model_list(loading.list_models()).root
    out = _render_at_80(monkeypatch, render_catalog.models_table, models)
    assert all(len(line) <= 80 for line in out.splitlines())
    for m in models:
        assert f" {m.name} " in out, m.name  # whole, on one line: never cut or wrapped
    profiles = hardware_list(loading.list_hardware()).root
    out = _render_at_80(monkeypatch, render_catalog.hardware_table, profiles)
    for h in profiles:
        assert f" {h.name} " in out, h.name


def test_reports_are_frozen_typed_and_their_json_is_the_cli_json(cli):
    r = model_report(loading.load_model("deepseek-v3"))
    assert isinstance(r, ModelReport)
    with pytest.raises(ValidationError):
        r.name = "other"  # type: ignore[misc]
    dumped = r.model_dump(mode="json")
    assert dumped == cli("models", "show", "deepseek-v3", "--json").json()
    assert dumped["derived"]["mla"]["kv_lora_rank"] == 512 and dumped["derived"]["num_experts"] == 256
    dense = model_report(loading.load_model("llama-3.1-8b")).model_dump(mode="json")
    assert "mla" not in dense["derived"] and "num_experts" not in dense["derived"]  # absent, not null
    assert dense["derived"]["sliding_window_tokens"] is None  # present as null, as before
    listed = cli("hardware", "--json").json()
    assert isinstance(listed, list) and {h["name"] for h in listed} == set(loading.bundled_names(loading.hardware_profiles_dir()))
    assert HardwareReport.model_validate(listed[0]).name == listed[0]["name"]
