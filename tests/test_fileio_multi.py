"""Several files written all or none (`fileio.write_files_atomic`): every target checked and every
file staged beside its target before any is renamed into place; a failure anywhere replaces
nothing and leaves no temporary file. Outputs that name one file are refused before anything is
written (`check_distinct_outputs`, `check_output_targets`)."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pytest

from shardplan import fileio
from shardplan.errors import EXIT_BAD_INPUT, ShardplanError
from shardplan.fileio import PendingFile, check_distinct_outputs, check_output_targets, write_files_atomic


def _pending(*pairs: tuple[Path, str], executable: bool = False) -> list[PendingFile]:
    return [PendingFile(path=p, data=text.encode(), executable=executable) for p, text in pairs]


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_every_file_is_written_and_scripts_are_executable(tmp_path):
    a, b = tmp_path / "a.yaml", tmp_path / "sub" / "b.sh"
    b.parent.mkdir()
    a.write_text("old a")
    write_files_atomic([*_pending((a, "new a")), *_pending((b, "new b"), executable=True)])
    assert a.read_text() == "new a" and b.read_text() == "new b"
    assert b.stat().st_mode & stat.S_IXUSR and not a.stat().st_mode & stat.S_IXUSR
    assert _names(tmp_path) == ["a.yaml", "sub"] and _names(b.parent) == ["b.sh"]  # no temporary left


def test_a_folder_in_the_way_of_the_last_file_replaces_none(tmp_path):
    a, b = tmp_path / "serve.sh", tmp_path / "build.sh"
    a.write_text("old serve")
    b.mkdir()
    with pytest.raises(ShardplanError, match="is a directory") as info:
        write_files_atomic(_pending((a, "new serve"), (b, "new build")))
    assert info.value.source == str(b) and info.value.exit_code == EXIT_BAD_INPUT
    assert a.read_text() == "old serve" and b.is_dir()
    assert _names(tmp_path) == ["build.sh", "serve.sh"]


def test_a_missing_folder_for_one_file_writes_none(tmp_path):
    a, b = tmp_path / "plan.yaml", tmp_path / "missing" / "serve.sh"
    with pytest.raises(ShardplanError, match="cannot write") as info:
        write_files_atomic(_pending((a, "plan"), (b, "serve")))
    assert info.value.source == str(b)
    assert _names(tmp_path) == []  # the first file's staged copy is gone too


def test_a_write_that_fails_while_staging_replaces_none(tmp_path, monkeypatch):
    a, b = tmp_path / "plan.yaml", tmp_path / "serve.sh"
    a.write_text("old plan")
    real_open = os.open

    def refuse_the_second(path, flags, mode=0o777):
        if Path(path).name.startswith(".serve.sh."):
            raise OSError(errno.EACCES, "Permission denied")
        return real_open(path, flags, mode)

    monkeypatch.setattr(fileio.os, "open", refuse_the_second)
    with pytest.raises(ShardplanError) as info:
        write_files_atomic(_pending((a, "new plan"), (b, "new serve")))
    assert info.value.one_line() == f"{b}: cannot write: Permission denied (fix: check that the folder exists and is writable)"
    assert a.read_text() == "old plan" and _names(tmp_path) == ["plan.yaml"]


def test_a_rename_that_fails_puts_back_the_files_already_replaced(tmp_path, monkeypatch):
    a, b, c = tmp_path / "a.yaml", tmp_path / "b.yaml", tmp_path / "c.yaml"
    a.write_text("old a")  # replaced, then put back
    real_replace = os.replace

    def fail_on_c(src, dst):
        if Path(dst) == c:
            raise OSError(errno.EBUSY, "Device or resource busy")
        return real_replace(src, dst)

    monkeypatch.setattr(fileio.os, "replace", fail_on_c)
    with pytest.raises(ShardplanError, match="Device or resource busy") as info:
        write_files_atomic(_pending((a, "new a"), (b, "new b"), (c, "new c")))
    assert info.value.source == str(c)
    assert a.read_text() == "old a"  # its old file is back
    assert _names(tmp_path) == ["a.yaml"]  # b was new: removed; no staged file or saved copy left


@pytest.mark.parametrize("second", ["same", "dotdot", "symlink", "hardlink"])
def test_two_names_of_one_file_are_refused_before_anything_is_written(tmp_path, second):
    target = tmp_path / "plan.yaml"
    target.write_text("old")
    other = {"same": target, "dotdot": tmp_path / "sub" / ".." / "plan.yaml",
             "symlink": tmp_path / "link.yaml", "hardlink": tmp_path / "hard.yaml"}[second]
    (tmp_path / "sub").mkdir()
    if second == "symlink":
        other.symlink_to(target)
    if second == "hardlink":
        os.link(target, other)
    before = _names(tmp_path)
    files = [PendingFile(path=target, data=b"manifest", what="-o"),
             PendingFile(path=other, data=b"moves", what="--moves")]
    with pytest.raises(ShardplanError, match="-o and --moves name the same file") as info:
        write_files_atomic(files)
    assert info.value.exit_code == EXIT_BAD_INPUT
    assert target.read_text() == "old" and _names(tmp_path) == before


def test_a_link_to_a_file_not_yet_written_is_that_file(tmp_path):
    link = tmp_path / "link.yaml"
    link.symlink_to(tmp_path / "new.yaml")  # dangling until written
    with pytest.raises(ShardplanError, match="--plot and -o name the same file"):
        check_distinct_outputs([("--plot", tmp_path / "new.yaml"), ("-o", link)])
    check_distinct_outputs([("-o", tmp_path / "new.yaml"), ("--moves", tmp_path / "new.moves.json"), ("--plot", None)])


def test_output_targets_are_checked_before_any_work(tmp_path):
    (tmp_path / "dir").mkdir()
    with pytest.raises(ShardplanError, match="is a directory"):
        check_output_targets([("-o", tmp_path / "plan.yaml"), ("--moves", tmp_path / "dir")])
    with pytest.raises(ShardplanError, match="no folder") as info:
        check_output_targets([("-o", tmp_path / "missing" / "plan.yaml")])
    assert info.value.source == str(tmp_path / "missing" / "plan.yaml")
    check_output_targets([("-o", tmp_path / "plan.yaml"), ("--plot", None)])
    assert _names(tmp_path) == ["dir"]  # checking writes nothing
