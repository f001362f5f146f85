"""The deployment manifest: built from real estimates, written atomically, read back to the
same bytes, and refused with one line naming the field when a hand edit makes it impossible."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest
import yaml

import shardplan
from conftest import build_plan
from shardplan import fileio
from shardplan.plan import manifest as mf
from shardplan.plan import schema as schema
from shardplan.cost.layout import Layout, PipelineSchedule
from shardplan.cost.workload import InferenceWorkload, TrainingWorkload
from shardplan.errors import InputFileError, ShardplanError
from shardplan.specs.loading import load_model

SNAPSHOT = Path(__file__).parents[1] / "snapshots" / "manifest_schema.json"


def _build(model: str, gpus: int, layout: Layout, workload, gpus_per_node: int | None = None, **extra):
    return build_plan(model, gpus, layout, workload, gpus_per_node=gpus_per_node, **extra)


@lru_cache(maxsize=None)
def serving_8b():
    """llama-3.1-8b served by 4 replicas of tp=2 on one node."""
    return _build("llama-3.1-8b", 8, Layout(tp=2, dp=4), InferenceWorkload(), objective="throughput",
                  search={"num_evaluated": 12, "num_rejected": 3, "best_score": 1234.5, "rejected_most": "memory"})


@lru_cache(maxsize=None)
def training_70b():
    """llama-3.1-70b trained on two nodes: tp=8 inside a node, pp=2 across them, ZeRO-1."""
    return _build("llama-3.1-70b", 16, Layout(tp=8, pp=2, dp=1, zero_stage=1), TrainingWorkload())


@lru_cache(maxsize=None)
def training_mixtral():
    """mixtral-8x7b: ep=4 folds over dp x tp = 4 x 2 ranks (etp defaults to 1)."""
    return _build("mixtral-8x7b", 8, Layout(tp=2, dp=4, ep=4), TrainingWorkload())


def _write_data(tmp_path: Path, data: dict, name: str = "plan.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _load_error(tmp_path: Path, data: dict) -> InputFileError:
    path = _write_data(tmp_path, data)
    with pytest.raises(InputFileError) as info:
        mf.load_manifest(path)
    line = info.value.one_line()
    assert "\n" not in line and line.startswith(f"{path}:"), line
    return info.value


# ----- building ----------------------------------------------------------------------------


def test_serving_manifest_records_inputs_layout_and_predictions():
    m, report = serving_8b()
    assert (m.schema_version, m.shardplan_version) == (1, shardplan.__version__)
    assert list(type(m).model_fields)[0] == "schema_version"
    assert m.model.name == "llama-3.1-8b" and m.model.hf_id == "meta-llama/Llama-3.1-8B"
    assert m.model.source == "bundled:llama-3.1-8b"  # the same on every machine
    assert (m.model.num_layers, m.model.num_attention_heads, m.model.num_kv_heads, m.model.num_experts) == (32, 32, 8, None)
    assert m.model.num_params == report["model"]["num_params"] == 8_030_261_248
    assert (m.hardware.num_gpus, m.hardware.num_nodes, m.hardware.gpus_per_node) == (8, 1, 8)
    assert m.hardware.memory_capacity_bytes == report["hardware"]["memory_capacity_bytes"]
    assert m.workload.kind == "inference" and m.workload.max_num_seqs == 256 and m.workload.kv_cache_dtype is None
    assert (m.layout.tp, m.layout.dp, m.layout.pp, m.layout.ep, m.layout.etp) == (2, 4, 1, 1, 2)
    assert (m.layout.weight_quantization, m.layout.kv_cache_dtype) == ("none", "bf16")
    t = report["time"]
    assert m.predicted.time.kind == "inference"
    assert m.predicted.time.ttft_seconds == t["ttft_seconds"] and m.predicted.time.batch_size == t["batch_size"]
    assert m.predicted.time.decode_step_breakdown_seconds == t["breakdown"]["decode_step"]
    assert m.predicted.kv_cache.capacity_tokens == report["kv_cache"]["capacity_tokens"] > 0
    assert m.predicted.kv_cache.block_size_tokens == 16
    assert m.predicted.fits is report["fits"] is True
    assert m.predicted.memory.binding_component == "kv_cache"
    assert m.predicted.memory.per_gpu_bytes == report["memory"]["per_gpu_bytes"]
    assert [s.stage for s in m.predicted.memory.stages] == [0]
    assert m.objective == "throughput" and m.search["num_evaluated"] == 12 and m.search["best_score"] == 1234.5
    assert "pipeline_p2p: one hop per stage boundary per pass, not overlapped" in m.assumptions
    assert m.assumptions[-1].startswith("hardware_efficiency: profile 'h100-sxm-80gb' attains matmul 0.8")


def test_training_manifest_places_two_stages_on_two_nodes():
    m, report = training_70b()
    assert (m.hardware.num_gpus, m.hardware.num_nodes) == (16, 2)
    assert (m.layout.tp, m.layout.pp, m.layout.dp, m.layout.zero_stage) == (8, 2, 1, 1)
    assert (m.layout.weight_quantization, m.layout.kv_cache_dtype) == (None, None)
    assert [(a.axis, a.size) for a in m.placement.mesh_shape] == [("pp", 2), ("dp", 1), ("cp", 1), ("tp", 8)]
    s0, s1 = m.placement.stages
    assert s0.layer_ranges == [[0, 39]] and s1.layer_ranges == [[40, 79]]
    assert (s0.first_rank, s0.last_rank, s0.nodes) == (0, 7, [0, 0])
    assert (s1.first_rank, s1.last_rank, s1.nodes) == (8, 15, [1, 1])
    assert (s0.embedding, s0.lm_head, s1.embedding, s1.lm_head) == (True, False, False, True)
    assert m.placement.experts is None
    t = m.predicted.time
    assert t.kind == "training" and t.step_seconds == report["time"]["step_seconds"] > 0
    assert t.num_microbatches == 512 and t.mfu == report["time"]["mfu"]
    assert t.breakdown_seconds["total"] == pytest.approx(sum(v for k, v in t.breakdown_seconds.items() if k != "total"))
    assert [s.per_gpu_bytes["total"] for s in m.predicted.memory.stages] == [
        r["per_gpu_bytes"]["total"] for r in report["memory"]["per_rank"]
    ]
    assert m.predicted.kv_cache is None
    keys = [a.split(":")[0] for a in m.assumptions]
    assert keys == [*report["time"]["overlap_assumptions"], "flop_convention", "hardware_efficiency"]


def test_uneven_pipeline_gives_earlier_stages_the_extra_layers():
    m, _ = _build("llama-3.1-405b", 32, Layout(tp=8, pp=4), InferenceWorkload())
    assert [s.layer_ranges for s in m.placement.stages] == [[[0, 31]], [[32, 63]], [[64, 94]], [[95, 125]]]
    assert [(s.first_rank, s.last_rank, s.nodes) for s in m.placement.stages] == [
        (8 * i, 8 * i + 7, [i, i]) for i in range(4)
    ]


def test_a_stage_may_span_nodes_and_node_is_rank_over_gpus_per_node():
    m, _ = _build("llama-3.1-8b", 16, Layout(tp=4, pp=2, dp=2), InferenceWorkload(), gpus_per_node=4)
    assert (m.hardware.num_nodes, m.hardware.gpus_per_node, m.placement.gpus_per_node) == (4, 4, 4)
    assert [(s.first_rank, s.last_rank, s.nodes) for s in m.placement.stages] == [(0, 7, [0, 1]), (8, 15, [2, 3])]


def test_interleaved_stages_hold_every_pp_th_chunk():
    layout = Layout(tp=8, pp=2, virtual_stages=2, pp_schedule=PipelineSchedule.INTERLEAVED, zero_stage=1)
    m, _ = _build("llama-3.1-70b", 16, layout, TrainingWorkload())
    assert [s.layer_ranges for s in m.placement.stages] == [[[0, 19], [40, 59]], [[20, 39], [60, 79]]]


def test_experts_split_evenly_over_expert_parallel_ranks():
    m, _ = training_mixtral()
    assert (m.model.num_experts, m.layout.ep, m.layout.etp) == (8, 4, 1)
    assert m.placement.experts.experts_per_rank == 2
    assert m.placement.experts.expert_ranges == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert m.placement.tp_splits["mlp.experts.down_proj.weight"] == "row"
    assert m.placement.tp_splits["mlp.gate.weight"] == "replicated"  # the router
    assert "mlp.down_proj.weight" not in m.placement.tp_splits  # every Mixtral layer is MoE


def test_tp_splits_follow_the_weight_inventory():
    m, _ = serving_8b()
    s = m.placement.tp_splits
    assert list(s)[0] == "embed_tokens.weight" and list(s)[-1] == "lm_head.weight"
    assert (s["embed_tokens.weight"], s["lm_head.weight"]) == ("vocab", "vocab")
    assert (s["self_attn.q_proj.weight"], s["self_attn.k_proj.weight"], s["self_attn.o_proj.weight"]) == (
        "column", "kv_column", "row")
    assert (s["mlp.gate_proj.weight"], s["mlp.down_proj.weight"], s["norm0.weight"]) == ("column", "row", "replicated")


def test_spec_hash_ignores_where_the_spec_was_read_from(tmp_path):
    m, _ = serving_8b()
    copied = tmp_path / "renamed.yaml"
    shutil.copy(load_model("llama-3.1-8b").origin, copied)
    spec = load_model(str(copied)).spec
    assert spec.source != load_model("llama-3.1-8b").spec.source
    assert mf.spec_sha256(spec) == m.model.spec_sha256
    canonical = json.dumps({k: v for k, v in spec.model_dump(mode="json", exclude_defaults=True).items() if k != "source"},
                           sort_keys=True, separators=(",", ":"))
    assert m.model.spec_sha256 == hashlib.sha256(canonical.encode()).hexdigest()
    assert mf.spec_sha256(spec.model_copy(update={"num_layers": 31})) != m.model.spec_sha256


def test_workload_sections_mirror_the_workload_dataclasses():
    from dataclasses import fields

    pairs = ((schema.InferenceWorkloadSection, InferenceWorkload), (schema.TrainingWorkloadSection, TrainingWorkload))
    for section, workload in pairs:
        assert list(section.model_fields) == ["kind", *(f.name for f in fields(workload))]


# ----- bytes -------------------------------------------------------------------------------


@pytest.mark.parametrize("case", [serving_8b, training_70b, training_mixtral])
def test_write_load_dump_round_trips_to_identical_bytes(tmp_path, case):
    m, _ = case()
    path = tmp_path / "plan.yaml"
    mf.write_manifest(m, path)
    text = path.read_text()
    assert text == mf.dump_manifest(m) and text.startswith("schema_version: 1\nshardplan_version:")
    loaded = mf.load_manifest(path)
    assert loaded == m
    assert mf.dump_manifest(loaded) == text
    # Every float comes back bit for bit, not merely close.
    assert _float_reprs(loaded) == _float_reprs(m) and len(_float_reprs(m)) > 20


def _float_reprs(m: mf.DeploymentManifest) -> list[str]:
    return [repr(v) for v in _leaves(m.model_dump()) if isinstance(v, float)]


def _leaves(data):
    if isinstance(data, dict):
        for v in data.values():
            yield from _leaves(v)
    elif isinstance(data, list):
        for v in data:
            yield from _leaves(v)
    else:
        yield data


def test_same_inputs_give_same_bytes_in_this_and_another_process():
    first = mf.dump_manifest(_build("llama-3.1-70b", 16, Layout(tp=8, pp=2, zero_stage=1), TrainingWorkload())[0])
    assert first == mf.dump_manifest(training_70b()[0])
    code = (
        "import sys; sys.path[:0] = sys.argv[1:3]; import test_manifest as t; "
        "sys.stdout.write(t.mf.dump_manifest(t.training_70b()[0]))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent), str(Path(__file__).parents[1])], capture_output=True, text=True,
                         env=env, check=True).stdout
    assert out == first


# ----- refusing impossible or foreign files --------------------------------------------------


def test_newer_schema_is_refused_before_its_unknown_fields(tmp_path):
    data = serving_8b()[0].model_dump(mode="json")
    data.update(schema_version=2, field_from_the_future={"x": 1})
    err = _load_error(tmp_path, data)
    assert err.field == "schema_version"
    assert "newer" in err.one_line() and "schema 2; this one reads up to 1" in err.one_line()
    assert err.hint == "upgrade shardplan"


def _edit(data: dict, dotted: str, value) -> dict:
    data = copy.deepcopy(data)
    *parents, last = dotted.split(".")
    node = data
    for p in parents:
        node = node[int(p)] if isinstance(node, list) else node[p]
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return data


@pytest.mark.parametrize(
    "case, dotted, value, field, words",
    [
        (serving_8b, "layout.tp", 4, "layout", "tp x pp x cp x dp = 4 x 1 x 1 x 4 = 16 is not the 8 GPUs"),
        (training_70b, "layout.tp", 4, "layout", "tp x pp x cp x dp"),
        (serving_8b, "model.num_attention_heads", 33, "layout.tp", "does not divide the 33 attention heads"),
        (serving_8b, "model.num_kv_heads", 3, "layout.tp", "neither divides the other"),
        (serving_8b, "layout.ep", 2, "layout.ep", "needs a mixture-of-experts model"),
        (training_mixtral, "layout.ep", 3, "layout.ep", "does not divide the 8 experts"),
        (training_70b, "layout.virtual_stages", 41, "layout.pp", "pp x virtual_stages = 82 exceeds the 80 layers"),
        (training_70b, "layout.zero_stage", 4, "layout.zero_stage", "less than or equal to 3"),
        (training_70b, "hardware.gpus_per_node", 4, "hardware.num_gpus", "16 GPUs is not 2 node(s) of 4"),
        (training_70b, "placement.stages.1.layer_ranges", [[41, 79]], "placement.stages.1.layer_ranges", "0..79 in order"),
        (training_70b, "placement.stages.0.layer_ranges", [[0, 40]], "placement.stages.1.layer_ranges", "0..79 in order"),
        (training_70b, "placement.stages.1.layer_ranges", [[40, 78]], "placement.stages", "not 79"),
        (training_70b, "placement.stages.1.first_rank", 7, "placement.stages.1", "do not follow from the layout"),
        (training_70b, "placement.stages.0.nodes", [0, 1], "placement.stages.0", "do not follow from the layout"),
        (training_70b, "placement.mesh_axis_order", ["tp", "cp", "dp", "pp"], "placement.mesh_axis_order", "must be"),
        (training_mixtral, "placement.experts.expert_ranges", [[0, 1], [2, 3], [4, 5], [5, 7]], "placement.experts", "evenly"),
        (training_70b, "placement.experts", {"experts_per_rank": 1, "expert_ranges": [[0, 0]]}, "placement.experts",
         "must be null unless ep > 1"),
        (training_70b, "placement.stages.0.layer_ranges", [[0, 19], [20, 39]], "placement.stages.0.layer_ranges",
         "2 chunks for virtual_stages=1"),
        (serving_8b, "layout.weight_quantization", None, "layout.weight_quantization", "serving only"),
        (serving_8b, "layout.tp", "2", "layout.tp", "valid integer"),
        (serving_8b, "workload.max_num_seqs", 2.5, "workload.max_num_seqs", "valid integer"),
        (training_70b, "predicted.time.step_seconds", "fast", "predicted.time.step_seconds", "valid number"),
        (serving_8b, "search.num_evaluated", True, "search.num_evaluated", "valid integer"),
        (serving_8b, "layout.recompute", "some", "layout.recompute", "'none', 'selective' or 'full'"),
        (serving_8b, "workload.max_model_len", 1000, "workload.input_len",
         "input_len 1024 + output_len 128 exceed max_model_len 1000"),
    ],
)
def test_impossible_edits_are_refused_naming_the_field(tmp_path, case, dotted, value, field, words):
    err = _load_error(tmp_path, _edit(case()[0].model_dump(mode="json"), dotted, value))
    assert err.field == field, err.one_line()
    assert words in err.one_line()


def test_a_removed_stage_is_refused(tmp_path):
    data = training_70b()[0].model_dump(mode="json")
    data["placement"]["stages"].pop()
    err = _load_error(tmp_path, data)
    assert (err.field, err.message) == ("placement.stages", "1 stages for pp=2")


@pytest.mark.parametrize(
    "section, right, wrong",
    [("layout", "sequence_parallel", "sequence_paralel"), ("workload", "max_num_seqs", "max_num_seqz")],
)
def test_a_misspelt_key_is_named_with_a_suggestion(tmp_path, section, right, wrong):
    data = serving_8b()[0].model_dump(mode="json")
    data[section][wrong] = data[section].pop(right)
    err = _load_error(tmp_path, data)
    assert err.field == f"{section}.{wrong}" and "unknown key" in err.one_line()
    assert f"did you mean '{right}'" in err.one_line()


@pytest.mark.parametrize(
    "text, words",
    [("- 1\n- 2\n", "expected a mapping at the top level, got list"), ("schema_version: [1\n", "invalid YAML")],
)
def test_files_that_are_not_manifests(tmp_path, text, words):
    path = tmp_path / "plan.yaml"
    path.write_text(text)
    with pytest.raises(InputFileError) as info:
        mf.load_manifest(path)
    assert words in info.value.one_line() and str(path) in info.value.one_line()


def test_missing_file_names_the_file(tmp_path):
    path = tmp_path / "nowhere" / "plan.yaml"
    with pytest.raises(InputFileError) as info:
        mf.load_manifest(path)
    assert info.value.one_line() == f"{path}: file not found (fix: check the path)"


# ----- atomic writes -------------------------------------------------------------------------


def test_write_replaces_the_file_and_leaves_nothing_else(tmp_path):
    path = tmp_path / "plan.yaml"
    mf.write_manifest(training_70b()[0], path)
    mf.write_manifest(serving_8b()[0], str(path))
    assert sorted(os.listdir(tmp_path)) == ["plan.yaml"]
    assert path.read_text() == mf.dump_manifest(serving_8b()[0])


def test_new_file_mode_follows_the_umask(tmp_path):
    old = os.umask(0o027)
    try:
        mf.write_manifest(serving_8b()[0], tmp_path / "plan.yaml")
    finally:
        os.umask(old)
    assert (tmp_path / "plan.yaml").stat().st_mode & 0o777 == 0o640


def test_failed_dump_leaves_the_old_file_untouched(tmp_path, monkeypatch):
    path = tmp_path / "plan.yaml"
    path.write_bytes(b"old contents\n")

    def broken(m):
        raise RuntimeError("dump failed")

    monkeypatch.setattr(mf, "dump_manifest", broken)
    with pytest.raises(RuntimeError, match="dump failed"):
        mf.write_manifest(serving_8b()[0], path)
    assert path.read_bytes() == b"old contents\n"
    assert os.listdir(tmp_path) == ["plan.yaml"]


def test_failed_disk_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "plan.yaml"
    path.write_bytes(b"old contents\n")

    def no_space(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(fileio.os, "fsync", no_space)
    with pytest.raises(ShardplanError) as info:
        mf.write_manifest(serving_8b()[0], path)
    assert info.value.one_line() == (
        f"{path}: cannot write: No space left on device (fix: check that the folder exists and is writable)"
    )
    assert path.read_bytes() == b"old contents\n"
    assert os.listdir(tmp_path) == ["plan.yaml"]


def test_write_into_a_missing_folder_names_the_path(tmp_path):
    path = tmp_path / "missing" / "plan.yaml"
    with pytest.raises(ShardplanError) as info:
        mf.write_manifest(serving_8b()[0], path)
    assert info.value.source == str(path) and "cannot write" in info.value.message
    assert not (tmp_path / "missing").exists()


# ----- the schema itself ---------------------------------------------------------------------


def test_json_schema_matches_the_snapshot():
    schema = mf.manifest_json_schema()
    assert schema["additionalProperties"] is False and list(schema["properties"])[0] == "schema_version"
    text = json.dumps(schema, indent=2, sort_keys=True) + "\n"
    if os.environ.get("SHARDPLAN_UPDATE_SNAPSHOTS") == "1":
        SNAPSHOT.parent.mkdir(exist_ok=True)
        SNAPSHOT.write_text(text)
    assert SNAPSHOT.is_file(), f"{SNAPSHOT} is missing: run SHARDPLAN_UPDATE_SNAPSHOTS=1 pytest {__file__}"
    assert SNAPSHOT.read_text() == text, (
        "the manifest schema changed: if on purpose, bump SCHEMA_VERSION when old files no longer load, then "
        f"regenerate with SHARDPLAN_UPDATE_SNAPSHOTS=1 pytest {__file__} and review the diff"
    )


def test_a_plan_written_before_the_spec_hash_left_defaults_out_still_reads_back():
    """Plans written up to 87a50f0 hashed the full dump: Llama 3.2 1B's was 0fcbf056... (the
    train-1gpu Kubernetes snapshot at that commit). It must still match; a changed spec must not."""
    from shardplan.plan.readback import matches_plan

    m, _ = serving_8b()
    spec = load_model("llama-3.2-1b").spec
    old_hash = "0fcbf0566dcd9b3e52b7b5f8af49b6d7e612cdb84b46e8a4c2d5d2eeeb2dc506"
    assert mf.legacy_spec_sha256(spec) == old_hash != mf.spec_sha256(spec)
    old_plan = m.model_copy(update={"model": m.model.model_copy(update={"spec_sha256": old_hash})})
    assert matches_plan(spec, old_plan)
    assert not matches_plan(spec.model_copy(update={"num_layers": 15}), old_plan)
    # A spec using a field old plans could not express has no legacy hash.
    assert mf.legacy_spec_sha256(spec.model_copy(update={"attention_sinks": True})) is None
