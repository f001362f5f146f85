"""`shardplan checkpoint PLAN org/name`: a Hub checkpoint's headers, read without its weights.

The network layer is mocked: `get_safetensors_metadata` and `get_paths_info` answer from real
safetensors files written in tmp_path (what the Hub would serve), and the commit comes from a
real huggingface_hub cache holding the repository's config.json. The figures must be exactly
those the same files give when read locally."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import huggingface_hub.constants
import huggingface_hub.file_download
import numpy as np
import pytest
from conftest import build_plan
from huggingface_hub.utils import SafetensorsFileMetadata, SafetensorsRepoMetadata, TensorInfo
from safetensors.numpy import save_file

from shardplan.cost.layout import Layout
from shardplan.cost.workload import InferenceWorkload
from shardplan.errors import InputFileError
from shardplan.plan.manifest import write_manifest
from shardplan.plan.placement import model_tensors
from shardplan.specs import hub
from shardplan.specs.loading import load_model
from shardplan.tasks.checkpoint import remote_checkpoint

COMMIT = "fedcba9876543210fedcba9876543210fedcba98"
SPEC = load_model("debug").spec
INDEX = "model.safetensors.index.json"


def _write_checkpoint(folder: Path, num_files: int) -> Path:
    """The debug model's tensors (fp32, its spec's dtype) in one file or `num_files` shards + index."""
    folder.mkdir(parents=True)
    tensors = {t.name: np.zeros(t.shape, np.float32) for t in model_tensors(SPEC)}
    if num_files == 1:
        save_file(tensors, str(folder / "model.safetensors"))
        return folder
    names, weight_map = list(tensors), {}
    for i in range(num_files):
        rel = f"model-{i + 1:05d}-of-{num_files:05d}.safetensors"
        save_file({n: tensors[n] for n in names[i::num_files]}, str(folder / rel))
        weight_map.update({n: rel for n in names[i::num_files]})
    (folder / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def _header(path: Path) -> dict:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n])


def _served_by(folder: Path, calls: list):
    """Mocks of the two Hub calls, answering from `folder` as huggingface_hub would."""
    def get_safetensors_metadata(repo_id, *, revision=None, **_):
        calls.append(("metadata", repo_id, revision))
        index = folder / INDEX
        wm = json.loads(index.read_text())["weight_map"] if index.exists() else None
        files = sorted(set(wm.values())) if wm else ["model.safetensors"]
        meta = {}
        for rel in files:
            h = _header(folder / rel)
            meta[rel] = SafetensorsFileMetadata(
                metadata=h.pop("__metadata__", {}),
                tensors={k: TensorInfo(dtype=v["dtype"], shape=v["shape"], data_offsets=tuple(v["data_offsets"]))
                         for k, v in h.items()})
        weight_map = wm or {k: "model.safetensors" for k in meta["model.safetensors"].tensors}
        return SafetensorsRepoMetadata(metadata={} if wm else None, sharded=bool(wm), weight_map=weight_map,
                                       files_metadata=meta)

    def get_paths_info(repo_id, paths, *, revision=None, **_):
        calls.append(("paths", repo_id, revision))
        return [SimpleNamespace(path=p, size=(folder / p).stat().st_size) for p in paths]

    return get_safetensors_metadata, get_paths_info


@pytest.fixture
def hub_env(tmp_path, monkeypatch):
    """Online (mocked), with org/debug's config.json cached at COMMIT (its refs/main)."""
    repo = tmp_path / "hub" / "models--org--debug"
    (repo / "snapshots" / COMMIT).mkdir(parents=True)
    (repo / "snapshots" / COMMIT / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub, "_resolves", lambda endpoint: True)  # the mocked Hub's name resolves

    def no_network(*a, **k):
        raise AssertionError("the test reached for the network")

    monkeypatch.setattr(huggingface_hub.file_download, "get_hf_file_metadata", no_network)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _plan(tmp_path: Path) -> Path:
    m, _ = build_plan("debug", 8, Layout(tp=2, pp=2, dp=2), InferenceWorkload(max_model_len=512, input_len=384, output_len=128), gpus_per_node=4)
    write_manifest(m, tmp_path / "plan.yaml")
    return tmp_path / "plan.yaml"


@pytest.mark.parametrize("num_files", [1, 3])
def test_hub_headers_give_the_figures_of_the_local_files(cli, hub_env, monkeypatch, num_files):
    folder = _write_checkpoint(hub_env / "served", num_files)
    calls: list = []
    meta, paths = _served_by(folder, calls)
    monkeypatch.setattr(huggingface_hub, "get_safetensors_metadata", meta)
    monkeypatch.setattr(huggingface_hub, "get_paths_info", paths)
    plan = _plan(hub_env)

    local = cli("checkpoint", plan, folder, "--json")
    remote = cli("checkpoint", plan, "org/debug", "--json")
    assert local.exit_code == 0 and remote.exit_code == 0, (local.stderr, remote.stderr)
    a, b = local.json(), remote.json()
    assert b.pop("checkpoint") == f"hf:org/debug@{COMMIT}"
    a.pop("checkpoint")
    assert a == b  # every byte range, file size and total
    assert len(b["files"]) == num_files and b["total_read_bytes"] > 0
    # both Hub calls pinned to the commit the revision resolved to
    assert calls == [("metadata", "org/debug", COMMIT), ("paths", "org/debug", COMMIT)]


def test_offline_hub_checkpoint_is_one_line(cli, hub_env, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    res = cli("checkpoint", _plan(hub_env), "org/debug")
    assert res.exit_code == 2 and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "HF_HUB_OFFLINE" in res.stderr and "org/debug" in res.stderr


def test_hostile_checkpoint_id_is_one_line(cli, hub_env):
    res = cli("checkpoint", _plan(hub_env), "org/debug@../../x")
    assert res.exit_code == 2 and len(res.stderr.strip().splitlines()) == 1 and "the revision must be" in res.stderr


# ----- what the Hub reports is checked like a local header ----------------------------------


def _remote(shards, weight_map=None):
    return hub.RemoteCheckpoint(
        ref=hub.HubRef("org/x"), commit=COMMIT,
        weight_map=weight_map or {n: s.file for s in shards for n in s.tensors}, shards=shards)


def _shard(file="model.safetensors", size=8 + 16 + 24, offsets=((0, 8), (8, 24))):
    tensors = {f"t{i}": hub.RemoteTensor(dtype="F32", shape=((b - a) // 4,), data_offsets=(a, b))
               for i, (a, b) in enumerate(offsets)}
    return hub.RemoteShard(file=file, size_bytes=size, tensors=tensors)


def test_offsets_are_absolute_from_the_file_size():
    _, stored, sizes = remote_checkpoint(_remote([_shard()]))
    assert [(t.data_start, t.nbytes) for t in stored] == [(24, 8), (32, 16)]  # 8 + a 16-byte header
    assert sizes == {"model.safetensors": 48}


@pytest.mark.parametrize("shard, words", [
    (_shard(offsets=((0, 8), (12, 24))), "does not tile"),  # a hole
    (_shard(offsets=((0, 12), (8, 24))), "does not tile"),  # an overlap
    (_shard(size=30), "does not tile"),  # no room for a header
    (_shard(file="../../etc/x.safetensors"), "not a plain name"),
])
def test_inconsistent_hub_headers_are_refused(shard, words):
    with pytest.raises(InputFileError) as info:
        remote_checkpoint(_remote([shard]))
    assert words in info.value.one_line()


def test_index_naming_a_tensor_no_shard_holds_is_refused():
    shard = _shard()
    with pytest.raises(InputFileError) as info:
        remote_checkpoint(_remote([shard], {"t0": shard.file, "t1": shard.file, "t9": shard.file}))
    assert "'t9'" in info.value.one_line()


def _hostile(offsets, shape=(2,)):
    return hub.RemoteShard(file="model.safetensors", size_bytes=48,
                           tensors={"t0": hub.RemoteTensor(dtype="F32", shape=shape, data_offsets=offsets)})


@pytest.mark.parametrize("shard", [
    _hostile((0, 8, 16)),  # three offsets
    _hostile(("0", "8")),  # strings
    _hostile((None, 8)),  # null
    _hostile((8, 0)),  # end before begin
    _hostile((0, 8), shape=(-1,)),  # a negative size
    _hostile((0, 8), shape=("2",)),
])
def test_hostile_hub_header_entries_are_input_errors_not_crashes(shard):
    """huggingface_hub hands the header's entries through unchecked: each must be two offsets,
    begin <= end, and a shape of sizes, or the header is refused in one line (exit 2)."""
    with pytest.raises(InputFileError) as info:
        remote_checkpoint(_remote([shard]))
    assert "data_offsets" in info.value.one_line() and "t0" in info.value.one_line()


def test_a_mistyped_local_path_is_not_sent_to_the_hub(tmp_path, monkeypatch):
    """`ckpts/llama-8b` with ./ckpts present is a path with a typo, not the Hub repository ckpts/llama-8b."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ckpts").mkdir()
    assert not hub.is_hub_candidate("ckpts/llama-8b")
    assert hub.is_hub_candidate("meta-llama/Llama-3.1-8B") and hub.is_hub_candidate("hf:ckpts/llama-8b")
