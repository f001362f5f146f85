"""Commands that write several files: outputs naming one file (the same path, a symbolic link, a
hard link, the manifest named like a file of its export) exit 2 before anything is written, and a
multi-file write is all or nothing: a file that cannot be written leaves every other output as it
was (no half-written export, no manifest without its export, no older file replaced)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import build_plan

from shardplan import fileio
from shardplan.cost.layout import Layout
from shardplan.cost.workload import InferenceWorkload, TrainingWorkload
from shardplan.plan.manifest import load_manifest, write_manifest

SERVE = InferenceWorkload(max_model_len=2048)
TRAIN = TrainingWorkload(seq_len=512, global_batch_size=64)
RECOMMEND = ("recommend", "debug", "--gpus", "2")


def _plan(tmp_path: Path, workload, gpus: int, name: str) -> Path:
    m, _ = build_plan("debug", gpus, Layout(dp=gpus), workload, gpus_per_node=8)
    assert m.predicted.fits
    path = tmp_path / name
    write_manifest(m, path)
    return path


def _tree(folder: Path) -> dict[str, str | None]:
    """Every path under `folder` with its text (None: a folder; a link: where it points): what a
    failed run must leave as it was."""
    return {str(p.relative_to(folder)): f"-> {os.readlink(p)}" if p.is_symlink() else None if p.is_dir() else p.read_text()
            for p in sorted(folder.rglob("*"))}


def _one_line(r, exit_code: int, *parts: str) -> None:
    assert r.exit_code == exit_code, (r.exit_code, r.stderr)
    assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("error: "), r.stderr
    for part in parts:
        assert part in r.stderr, r.stderr


# ----- outputs that name one file ------------------------------------------------------------


@pytest.mark.parametrize("how", ["same-path", "symlink", "hardlink"])
def test_replan_manifest_and_move_list_naming_one_file_exit_2(cli, tmp_path, how):
    old = _plan(tmp_path, TRAIN, 4, "train.yaml")
    out = tmp_path / "out"
    out.mkdir()
    manifest = out / "X.yaml"
    moves = {"same-path": manifest, "symlink": out / "link.yaml", "hardlink": out / "hard.yaml"}[how]
    if how == "symlink":
        moves.symlink_to(manifest)  # a link to a file not written yet
    if how == "hardlink":
        manifest.write_text("good old plan\n")
        os.link(manifest, moves)
    before = _tree(out)
    r = cli("replan", old, "--gpus", "8", "-o", manifest, "--moves", moves)
    _one_line(r, 2, "-o and --moves name the same file")
    assert _tree(out) == before


def test_replan_writes_its_manifest_and_move_list_when_they_differ(cli, tmp_path):
    old = _plan(tmp_path, TRAIN, 4, "train.yaml")
    r = cli("replan", old, "--gpus", "8", "-o", tmp_path / "X.yaml", "--moves", tmp_path / "X.moves.yaml", "--json")
    assert r.exit_code == 0, r.stderr
    assert load_manifest(tmp_path / "X.yaml").hardware.num_gpus == 8
    assert "moves" in (tmp_path / "X.moves.yaml").read_text()


def test_replan_move_list_into_a_folder_leaves_no_manifest(cli, tmp_path):
    old = _plan(tmp_path, TRAIN, 4, "train.yaml")
    (tmp_path / "moves").mkdir()
    r = cli("replan", old, "--gpus", "8", "-o", tmp_path / "X.yaml", "--moves", tmp_path / "moves")
    _one_line(r, 2, "is a directory")
    assert not (tmp_path / "X.yaml").exists()


def test_recommend_plot_over_the_manifest_exit_2(cli, tmp_path):
    same = tmp_path / "same.png"
    r = cli("recommend", "debug", "--gpus", "1", "-o", same, "--plot", same)
    _one_line(r, 2, "-o and --plot name the same file")
    assert not same.exists()


def test_recommend_manifest_named_like_a_file_of_its_export_exit_2(cli, tmp_path):
    old = "#!/bin/sh\necho an older serve.sh\n"
    (tmp_path / "serve.sh").write_text(old)
    r = cli(*RECOMMEND, "-o", tmp_path / "serve.sh", "--export", "vllm")
    _one_line(r, 2, "-o and the vllm export's serve.sh name the same file")
    assert _tree(tmp_path) == {"serve.sh": old}


# ----- all or nothing ------------------------------------------------------------------------


@pytest.mark.parametrize("target, workload, gpus, blocked", [
    ("trtllm", SERVE, 2, "extra_llm_api_options.yaml"),
    ("llamacpp", SERVE, 2, "README.txt"),
    ("deepspeed", TRAIN, 4, "launch.sh"),
])
def test_export_with_its_last_file_blocked_replaces_none(cli, tmp_path, target, workload, gpus, blocked):
    plan = _plan(tmp_path, workload, gpus, "plan.yaml")
    out = tmp_path / "out"
    (out / blocked).mkdir(parents=True)
    for name in ("serve.sh", "ds_config.json"):
        (out / name).write_text(f"an older {name}\n")
    before = _tree(out)
    r = cli("export", plan, "--to", target, "-o", out)
    _one_line(r, 2, f"{out / blocked}: is a directory")
    assert _tree(out) == before  # nothing written, nothing replaced, no temporary file left


def test_export_into_a_new_folder_that_fails_leaves_no_folder(cli, tmp_path, monkeypatch):
    plan = _plan(tmp_path, SERVE, 2, "plan.yaml")
    real_open = os.open

    def no_space_for_the_readme(path, flags, mode=0o777):
        if Path(path).name.startswith(".README.txt."):
            raise OSError(28, "No space left on device")
        return real_open(path, flags, mode)

    monkeypatch.setattr(fileio.os, "open", no_space_for_the_readme)
    r = cli("export", plan, "--to", "llamacpp", "-o", tmp_path / "new" / "llamacpp")
    _one_line(r, 2, "README.txt: cannot write: No space left on device")
    assert not (tmp_path / "new").exists()


def test_recommend_export_that_fails_leaves_the_old_manifest(cli, tmp_path):
    folder = tmp_path / "blk"
    (folder / "serve.sh").mkdir(parents=True)
    (folder / "plan.yaml").write_text("a good older plan\n")
    before = _tree(folder)
    r = cli(*RECOMMEND, "-o", folder / "plan.yaml", "--export", "vllm")
    _one_line(r, 2, f"{folder / 'serve.sh'}: is a directory")
    assert _tree(folder) == before


def test_recommend_export_writes_the_manifest_and_the_export_together(cli, tmp_path):
    r = cli(*RECOMMEND, "-o", tmp_path / "plan.yaml", "--export", "vllm", "--json")
    assert r.exit_code == 0, r.stderr
    out = r.json()
    assert out["manifest"] == str(tmp_path / "plan.yaml")  # the file written, not where it was staged
    assert out["export"]["files"] == [str(tmp_path / "serve.sh")]
    assert sorted(_tree(tmp_path)) == ["plan.yaml", "serve.sh"]
    m = load_manifest(tmp_path / "plan.yaml")
    assert m.hardware.num_gpus == 2 and m.predicted.fits
    assert f"--tensor-parallel-size {m.layout.tp}" in (tmp_path / "serve.sh").read_text() or m.layout.tp == 1


# ----- the plot is one of recommend's files -----------------------------------------------------------


@pytest.mark.parametrize("export", [None, "vllm"])
def test_recommend_plot_that_cannot_be_written_leaves_the_old_manifest(cli, tmp_path, monkeypatch, export):
    """A disk that fills as the plot is written (after the search) fails the whole write: the
    manifest named by -o (and the export) are not replaced or left half-written."""
    (tmp_path / "plan.yaml").write_text("a good older plan\n")
    before = _tree(tmp_path)
    real_open = os.open

    def no_space_for_the_plot(path, flags, mode=0o777, **kw):
        if Path(path).name.startswith(".plot.svg."):
            raise OSError(28, "No space left on device")
        return real_open(path, flags, mode, **kw)

    monkeypatch.setattr(fileio.os, "open", no_space_for_the_plot)
    r = cli(*RECOMMEND, "-o", tmp_path / "plan.yaml", "--plot", tmp_path / "plot.svg",
            *(["--export", export] if export else []))
    _one_line(r, 2, "plot.svg: cannot write: No space left on device")
    assert _tree(tmp_path) == before


@pytest.mark.parametrize("export", [None, "vllm"])
def test_recommend_writes_the_manifest_the_plot_and_the_export_together(cli, tmp_path, export):
    args = ["-o", tmp_path / "plan.yaml", "--plot", tmp_path / "plot.svg", "--json"]
    r = cli(*RECOMMEND, *args, *(["--export", export] if export else []))
    assert r.exit_code == 0, r.stderr
    assert r.json()["manifest"] == str(tmp_path / "plan.yaml")  # the file written, not where it was staged
    assert sorted(_tree(tmp_path)) == ["plan.yaml", "plot.svg", *(["serve.sh"] if export else [])]
    assert load_manifest(tmp_path / "plan.yaml").predicted.fits
    assert (tmp_path / "plot.svg").read_text().lstrip().startswith(("<?xml", "<svg"))
