"""Checkpoint headers and indexes from anyone: a header nested 100,000 levels deep, a key twice
in a header or in an index's weight_map are one-line errors naming the file (exit 2), for
`checkpoint` and for `replan --from-checkpoint`; an index that maps a million tensors to a few
files resolves each file once, and one naming more than MAX_SHARDS files is refused."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from conftest import build_plan
from safetensors.torch import save_file

from shardplan.cost.layout import Layout
from shardplan.cost.workload import InferenceWorkload
from shardplan.errors import InputFileError
from shardplan.plan.manifest import write_manifest
from shardplan.plan.placement import model_tensors
from shardplan.specs.loading import load_model
from shardplan.tasks import _safetensors
from shardplan.tasks.checkpoint import read_checkpoint

SPEC = load_model("debug").spec
INDEX = "model.safetensors.index.json"
FIRST = "model-00001-of-00002.safetensors"


def _sharded(folder: Path) -> Path:
    """debug's tensors (fp32, its spec's dtype) in two files and an index."""
    folder.mkdir(parents=True)
    shapes = {t.name: t.shape for t in model_tensors(SPEC)}
    names = list(shapes)
    weight_map = {}
    for i in range(2):
        rel = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: torch.zeros(shapes[n]) for n in names[i::2]}, str(folder / rel))
        weight_map.update({n: rel for n in names[i::2]})
    (folder / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def _edit_header(path: Path, edit) -> None:
    """Rewrite a safetensors file's JSON header as text, its data unchanged."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = edit(raw[8:8 + n].decode().rstrip())  # safetensors pads the header with spaces
    path.write_bytes(struct.pack("<Q", len(header.encode())) + header.encode() + raw[8 + n:])


def _plan(tmp_path: Path) -> Path:
    m, _ = build_plan("debug", 2, Layout(dp=2), InferenceWorkload(max_model_len=512, input_len=256, output_len=64),
                      gpus_per_node=2)
    write_manifest(m, tmp_path / "plan.yaml")
    return tmp_path / "plan.yaml"


def _one_line_error(cli, *args) -> str:
    r = cli(*args)
    assert r.exit_code == 2, r.stdout + r.stderr
    line = r.stderr.strip()
    assert "\n" not in line and "Traceback" not in line and "internal error" not in line and r.stdout == ""
    return line


def _both_commands(cli, plan: Path, ckpt: Path) -> list[str]:
    """The error of `checkpoint` and of `replan --from-checkpoint` (rank 0 lost: its replica reads)."""
    return [_one_line_error(cli, "checkpoint", plan, ckpt, "--json"),
            _one_line_error(cli, "replan", plan, "--gpus", "2", "--lost-ranks", "0", "--from-checkpoint", ckpt,
                            "--json")]


def test_the_fixture_is_read_as_it_is(tmp_path, cli):
    ckpt = _sharded(tmp_path / "ckpt")
    _edit_header(ckpt / FIRST, lambda h: h)  # rewritten unpadded: still a valid file
    r = cli("checkpoint", _plan(tmp_path), ckpt, "--json")
    assert r.exit_code == 0, r.stderr
    assert r.json()["num_tensors"] == 75


def test_a_header_nested_100000_levels_deep(tmp_path, cli):
    ckpt = _sharded(tmp_path / "ckpt")
    _edit_header(ckpt / FIRST, lambda h: h[:-1] + ', "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    for line in _both_commands(cli, _plan(tmp_path), ckpt):
        assert f"{ckpt / FIRST}: field 'header': header is nested more than 64 levels deep" in line


def test_a_header_nested_past_64_levels_under_the_parsers_limit(tmp_path, cli):
    ckpt = _sharded(tmp_path / "ckpt")
    _edit_header(ckpt / FIRST, lambda h: h[:-1] + ', "__metadata__": {"x": ' + "[" * 70 + "]" * 70 + "}}")
    for line in _both_commands(cli, _plan(tmp_path), ckpt):
        assert "header is nested more than 64 levels deep" in line


def test_a_tensor_twice_in_a_header(tmp_path, cli):
    ckpt = _sharded(tmp_path / "ckpt")

    def twice(h: str) -> str:
        name, entry = next((k, v) for k, v in json.loads(h).items() if k != "__metadata__")
        return h[:-1] + f", {json.dumps(name)}: {json.dumps(entry)}}}"

    _edit_header(ckpt / FIRST, twice)
    for line in _both_commands(cli, _plan(tmp_path), ckpt):
        assert f"{ckpt / FIRST}: field 'header': header holds the key" in line and "twice in one object" in line


def test_a_tensor_twice_in_the_weight_map(tmp_path, cli):
    ckpt = _sharded(tmp_path / "ckpt")
    text = (ckpt / INDEX).read_text()
    name, rel = next(iter(json.loads(text)["weight_map"].items()))
    (ckpt / INDEX).write_text(text[:-2] + f", {json.dumps(name)}: {json.dumps(rel)}}}}}")
    for line in _both_commands(cli, _plan(tmp_path), ckpt):
        assert f"{ckpt / INDEX}: the index holds the key '{name}' twice in one object" in line


def test_each_file_of_a_large_index_is_resolved_once(tmp_path, monkeypatch):
    """200,000 weight_map entries over the two files: two resolutions, not 200,000."""
    ckpt = _sharded(tmp_path / "ckpt")
    data = json.loads((ckpt / INDEX).read_text())
    resolved = []
    real = _safetensors._confined

    def counted(folder, name, source, field):
        resolved.append(name)
        return real(folder, name, source, field)

    monkeypatch.setattr(_safetensors, "_confined", counted)
    assert len(read_checkpoint(ckpt)[1]) == 75
    assert sorted(resolved) == sorted(set(data["weight_map"].values()))
    resolved.clear()
    data["weight_map"].update({f"model.layers.{i}.extra.weight": FIRST for i in range(200_000)})
    (ckpt / INDEX).write_text(json.dumps(data))
    with pytest.raises(InputFileError, match="tensor 'model.layers.0.extra.weight' is not in"):
        read_checkpoint(ckpt)
    assert sorted(resolved) == sorted(set(data["weight_map"].values()))


def test_an_index_naming_more_files_than_a_checkpoint_has(tmp_path, monkeypatch):
    ckpt = _sharded(tmp_path / "ckpt")
    data = json.loads((ckpt / INDEX).read_text())
    monkeypatch.setattr(_safetensors, "MAX_SHARDS", 3)
    data["weight_map"].update({f"extra.{i}": f"extra-{i}.safetensors" for i in range(2)})
    (ckpt / INDEX).write_text(json.dumps(data))
    with pytest.raises(InputFileError) as e:
        read_checkpoint(ckpt)
    assert e.value.one_line() == f"{ckpt / INDEX}: field 'weight_map': names more than 3 files (fix: a checkpoint " \
                                 "has at most that many shards; check the index)"
