"""Flag lists generated from the engines' own parsers (tools/dump_engine_flags.py, issue 26): the
generated files carry version, date and source; the script's pure parts (ast extraction,
deprecation marks) on a tiny fixture source; a deprecated flag in an export is reported."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest
import yaml

from shardplan.exporters.base import PINNED_VERSIONS, DeprecatedFlag, command, flag_table

REPO = Path(__file__).parents[2]
FLAGS = REPO / "shardplan" / "exporters" / "flags"


def _tool():
    spec = importlib.util.spec_from_file_location("dump_engine_flags", REPO / "tools" / "dump_engine_flags.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


dump = _tool()

GENERATED = sorted(p for p in FLAGS.glob("*.yaml") if "dump_engine_flags" in p.read_text().split("\nflags:")[0])
# TGI's launcher is Rust: its lists come from tools/dump_tgi_flags.py (tests/exporters/test_tgi_flags.py)
GENERATED_ELSEWHERE = {p.stem for p in FLAGS.glob("tgi-*.yaml") if "dump_tgi_flags" in p.read_text().split("\nflags:")[0]}


def test_the_pinned_and_older_engine_lists_are_generated_and_bundled():
    names = {p.stem for p in GENERATED} | GENERATED_ELSEWHERE
    assert {f"{e}-{v}" for e, v in PINNED_VERSIONS.items()} <= names
    assert {"vllm-0.11.0", "sglang-0.5.3"} <= names  # the pins before issue 26 stay for --engine-version


@pytest.mark.parametrize("path", GENERATED, ids=lambda p: p.stem)
def test_a_generated_list_carries_version_date_and_source(path):
    data = yaml.safe_load(path.read_text())
    engine, version = path.stem.split("-", 1)
    assert data["tool"] == engine and str(data["version"]) == version
    assert re.fullmatch(r"\d{4}-\d\d-\d\d", str(data["date"]))
    assert data["wheel"]["name"].startswith(f"{dump.ENGINES[engine].top}-{version}-") and data["wheel"]["name"].endswith(".whl")
    assert re.fullmatch(r"[0-9a-f]{64}", data["wheel"]["sha256"])
    assert data["sources"][0] == f"https://pypi.org/project/{dump.ENGINES[engine].package}/{version}/"
    t = flag_table(path.stem)
    assert len(t.flags) > 100 and all(isinstance(s.get("takes_value"), bool) for s in t.flags.values())
    assert all(s.get("note") for s in t.flags.values() if s.get("deprecated"))


def test_the_current_sglang_marks_disable_cuda_graph_deprecated_and_has_its_replacement():
    t = flag_table("sglang")
    assert t.flags["disable-cuda-graph"].get("deprecated") is True
    assert "disabled" in t.flags["cuda-graph-backend-decode"]["choices"]
    assert flag_table("sglang-0.5.3").flags["disable-cuda-graph"].get("deprecated") is None


# ----- the script's pure parts, on a fixture written here --------------------------------

FIXTURE = '''
import argparse
_OLD = "--old-knob is deprecated and will be removed in v9."

class EngineArgs:
    @staticmethod
    def add_cli_args(parser):
        g = parser.add_argument_group("x")
        g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
        g.add_argument("--dtype", choices=["auto", "bfloat16"], default="auto")
        g.add_argument("--enforce-eager", action="store_true")
        g.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction)
        g.add_argument("--old-knob", type=int, help=_OLD)
        g.add_argument("--legacy", action="store_true", deprecated=True)
        g.add_argument("--grpc-mode", action="store_true", help="(Deprecated, use --smg-grpc-mode) legacy.")
        g.add_argument("--smg-grpc-mode", action="store_true", help="Replaces the deprecated --grpc-mode.")
        g.add_argument("--disable-cuda-graph", action=DeprecatedStoreTrueAction, help="Deprecated. Use X.")
        g.add_argument("--hf-token", nargs="?", const=True)
        g.add_argument(f"--{computed}")

    def other(self, parser):
        parser.add_argument("--not-here")
'''


def test_ast_extraction_reads_names_switches_choices_and_deprecations():
    flags = dump.merge(dump.flags_from_argparse_source(FIXTURE, "EngineArgs", "add_cli_args"))
    assert list(flags) == sorted(["tensor-parallel-size", "dtype", "enforce-eager", "prefix-caching", "no-prefix-caching",
                                  "old-knob", "legacy", "grpc-mode", "smg-grpc-mode", "disable-cuda-graph", "hf-token"])
    assert flags["tensor-parallel-size"].takes_value and not flags["enforce-eager"].takes_value
    assert not flags["prefix-caching"].takes_value and not flags["no-prefix-caching"].takes_value
    assert flags["dtype"].choices == ["auto", "bfloat16"]
    assert flags["hf-token"].optional_value
    deprecated = {n for n, f in flags.items() if f.deprecated}
    assert deprecated == {"old-knob", "legacy", "grpc-mode", "disable-cuda-graph"}  # not smg-grpc-mode
    assert "will be removed in v9" in flags["old-knob"].note


def test_ast_extraction_of_click_options():
    src = '''
import click
@click.command()
@click.argument("model")
@click.option("--tp_size", type=int, default=1)
@click.option("--backend", type=click.Choice(["pytorch", "tensorrt"]), default="pytorch")
@click.option("--trust_remote_code", is_flag=True, default=False)
@click.option("--enable_x/--disable_x", default=True, help="[DEPRECATED] gone soon")
def serve(model, tp_size, backend, trust_remote_code, enable_x):
    pass
'''
    flags = dump.merge(dump.flags_from_click_source(src, "serve"))
    assert flags["tp_size"].takes_value and flags["backend"].choices == ["pytorch", "tensorrt"]
    assert not flags["trust_remote_code"].takes_value
    assert flags["enable_x"].deprecated and flags["disable_x"].deprecated and not flags["enable_x"].takes_value


def test_a_rendered_list_reads_back_through_flag_table(tmp_path, monkeypatch):
    flags = dump.merge(dump.flags_from_argparse_source(FIXTURE, "EngineArgs", "add_cli_args"))
    text = dump.render("vllm", "9.9.9", flags, wheel="vllm-9.9.9-cp38-abi3-any.whl", sha256="0" * 64, mode="ast",
                       date="2026-01-02", how="fixture")
    (tmp_path / "vllm-9.9.9.yaml").write_text(text)
    monkeypatch.setattr("shardplan.exporters.base.FLAGS_DIR", tmp_path)
    flag_table.cache_clear()
    try:
        t = flag_table("vllm-9.9.9")
        assert t.version == "9.9.9" and t.extra["wheel"]["sha256"] == "0" * 64 and t.extra["date"] == "2026-01-02"
        assert t.flags["legacy"] == {"takes_value": False, "deprecated": True}
    finally:
        flag_table.cache_clear()


# ----- the check -----------------------------------------------------------------------------


def test_a_deprecated_flag_in_an_export_is_reported():
    with pytest.warns(DeprecatedFlag, match=r"0\.5\.23 marks --disable-cuda-graph deprecated: Deprecated\. Use "):
        command(flag_table("sglang"), ["python", "-m", "sglang.launch_server"], [("disable-cuda-graph", None)])
    with pytest.warns(DeprecatedFlag, match="--enable-dp-attention"):
        flag_table("sglang").check("enable-dp-attention", None)


def test_a_flag_the_pinned_list_lacks_still_fails_the_export():
    with pytest.raises(AssertionError, match="has no flag --no-such-flag"):
        command(flag_table("sglang"), ["python", "-m", "sglang.launch_server"], [("no-such-flag", "1")])


@pytest.mark.parametrize("help_text,marked", [
    ("[DEPRECATED] use --x", True),
    ("Deprecated. Use --cuda-graph-backend-{decode,prefill}=disabled instead.", True),
    ("(Deprecated: use --y=auto) Enable z.", True),
    ("--log-config-file is deprecated and will be removed in v0.33.0.", True),
    ("vLLM IR op priority.\n\nDeprecated: vLLM IR is being removed.", True),
    ("Replaces the deprecated --grpc-mode.", False),
    ("JSON configuration. The fallback to that flag for external linkers is deprecated; ordinary use is not.", False),
    ("Whether to allow deprecated quantization methods.", False),
])
def test_which_help_texts_mark_a_flag_deprecated(help_text, marked):
    assert dump.is_deprecated(help_text=help_text) is marked


def test_eager_plans_use_sglangs_non_deprecated_flags_where_the_chosen_list_has_them():
    import warnings

    from shardplan.exporters import sglang

    new, old = flag_table("sglang"), flag_table("sglang-0.5.3")
    assert sglang.eager_args(new) == [("cuda-graph-backend-decode", "disabled"), ("cuda-graph-backend-prefill", "disabled")]
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecatedFlag)  # none of them is deprecated in 0.5.23
        command(new, ["python", "-m", "sglang.launch_server"], sglang.eager_args(new) + sglang.dp_attention_args(new, 4))
    assert sglang.eager_args(old) == [("disable-cuda-graph", None)]
    assert sglang.dp_attention_args(old, 4) == [("dp-size", 4), ("enable-dp-attention", None)]
    command(old, ["python", "-m", "sglang.launch_server"], sglang.eager_args(old) + sglang.dp_attention_args(old, 4))
