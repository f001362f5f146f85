"""At 80 columns tables drop or wrap secondary columns; no cell is cut to `…` and no line is
wider than the terminal."""

from __future__ import annotations

import re

from shardplan.cli import render_common
from shardplan.search.explain import describe


def _narrow(cli, monkeypatch, *args: str):
    monkeypatch.setattr(render_common.console, "width", 80)
    res = cli(*args)
    assert res.exit_code == 0, res.stderr
    lines = res.stdout.splitlines()
    assert "…" not in res.stdout
    assert all(len(line) <= 80 for line in lines), max(lines, key=len)
    return res.stdout, lines


def test_capacity_serving_drops_the_per_tp_columns_and_says_so(cli, monkeypatch):
    wide = cli("capacity", "llama-3.1-70b", "--json").json()
    out, _ = _narrow(cli, monkeypatch, "capacity", "llama-3.1-70b")
    for row in wide["formats"]:
        assert re.search(rf"│ {row['weight_dtype']} +│ +{row['min_num_gpus']} │", out), row["weight_dtype"]
    assert "tp=1, tp=2, tp=4, tp=8 left out" in " ".join(out.split())


def test_capacity_training_wraps_the_layout_instead_of_cropping_it(cli, monkeypatch):
    wide = cli("capacity", "llama-3.1-8b", "--workload", "training", "--max-gpus", "16", "--json").json()
    out, lines = _narrow(cli, monkeypatch, "capacity", "llama-3.1-8b", "--workload", "training", "--max-gpus", "16")
    words = set(" ".join(lines).replace("│", " ").split())
    for row in wide["rows"]:
        if row.get("plan") is not None:
            assert set(describe(row["plan"]).split()) <= words, row
