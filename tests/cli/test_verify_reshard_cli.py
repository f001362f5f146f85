"""`shardplan verify NEW --from OLD`: bad input is one line and exit 2 before anything starts;
--help names the option."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import build_plan
from shardplan.cost.layout import Layout
from shardplan.cost.workload import InferenceWorkload, Optimizer, TrainingWorkload
from shardplan.errors import EXIT_BAD_INPUT
from shardplan.plan import manifest as mf

SGD = TrainingWorkload(seq_len=256, global_batch_size=64, optimizer=Optimizer.SGD)


def _plan(tmp_path: Path, name: str, gpus: int, workload=SGD, model: str = "debug", **layout) -> Path:
    m, _ = build_plan(model, gpus, Layout(**layout), workload, gpus_per_node=2)
    path = tmp_path / f"{name}.yaml"
    mf.write_manifest(m, path)
    return path


def test_help_mentions_from(cli):
    out = " ".join(cli("verify", "--help").stdout.split())
    assert "--from" in out and "--lost-nodes" in out and "--lost-ranks" in out


@pytest.mark.parametrize("case, field", [
    ("serving", "workload.kind"),
    ("other model", "model.spec_sha256"),
    ("other optimizer", "workload.optimizer"),
    ("lost node out of range", "--lost-nodes"),
    ("lost ranks without --from", "--lost-ranks"),
    ("engine log with --from", "--engine-log"),
])
def test_bad_input_is_one_line_and_exit_2(cli, tmp_path, case, field):
    old = _plan(tmp_path, "old", 4, tp=2, dp=2)
    new = _plan(tmp_path, "new", 2, dp=2, zero_stage=3)
    args = ["verify", str(new), "--from", str(old)]
    if case == "serving":
        args[1] = str(_plan(tmp_path, "serve", 2, workload=InferenceWorkload(max_model_len=512, input_len=384, output_len=128), tp=2))
    elif case == "other model":
        args[1] = str(_plan(tmp_path, "llama", 2, model="llama-3.2-1b", dp=2, zero_stage=3))
    elif case == "other optimizer":
        args[1] = str(_plan(tmp_path, "adam", 2, workload=TrainingWorkload(seq_len=256, global_batch_size=64), dp=2))
    elif case == "lost node out of range":
        args += ["--lost-nodes", "2"]  # the old plan has nodes 0 and 1
    elif case == "lost ranks without --from":
        args = ["verify", str(new), "--lost-ranks", "2,3"]
    else:
        args += ["--engine-log", str(tmp_path / "vllm.log")]
    res = cli(*args)
    assert res.exit_code == EXIT_BAD_INPUT, (res.stdout, res.stderr)
    assert res.stdout == ""
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and f"'{field}'" in lines[0], lines
