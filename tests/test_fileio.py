"""Every file shardplan writes goes through fileio's atomic write, which renames a finished file over
the target: the target must be a file to replace, never a device, a FIFO or a folder (as root,
`-o /dev/null` would otherwise replace the system's /dev/null with a manifest)."""

from __future__ import annotations

import os
import stat

import pytest

from shardplan.errors import ShardplanError
from shardplan.fileio import write_text_atomic


def test_a_fifo_is_refused_and_left_as_it_was(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(ShardplanError, match="not a regular file"):
        write_text_atomic(fifo, "x")
    assert stat.S_ISFIFO(fifo.lstat().st_mode)
    assert [p.name for p in tmp_path.iterdir()] == ["pipe"]  # no temporary file left beside it


def test_a_folder_and_an_empty_name_are_refused(tmp_path):
    with pytest.raises(ShardplanError, match="is a directory"):
        write_text_atomic(tmp_path, "x")
    with pytest.raises(ShardplanError, match="needs a file name"):
        write_text_atomic("", "x")


def test_a_symbolic_link_is_written_through(tmp_path):
    target = tmp_path / "real.yaml"
    target.write_text("old")
    link = tmp_path / "link.yaml"
    link.symlink_to(target)
    write_text_atomic(link, "new")
    assert link.is_symlink() and target.read_text() == "new"


def test_a_link_to_a_fifo_is_refused(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    link = tmp_path / "link"
    link.symlink_to(fifo)
    with pytest.raises(ShardplanError, match="not a regular file"):
        write_text_atomic(link, "x")
    assert link.is_symlink() and stat.S_ISFIFO(fifo.lstat().st_mode)


def test_the_cli_refuses_a_device_target(cli, tmp_path):
    fifo = tmp_path / "out"
    os.mkfifo(fifo)
    r = cli("recommend", "debug", "--gpus", "1", "--input-len", "128", "--output-len", "32", "-o", str(fifo))
    assert r.exit_code == 2 and "not a regular file" in r.stderr
    assert stat.S_ISFIFO(fifo.lstat().st_mode)
