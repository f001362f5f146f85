"""`shardplan checkpoint`: real safetensors checkpoints of the `debug` model (one file and
sharded with an index), checked against the spec; per-rank byte ranges that read exactly the
rank's slice (compared with the tensor itself), and per-rank bytes that add up to the
checkpoint size times the replication the plan implies."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import torch
from conftest import build_plan
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

from shardplan.tasks.checkpoint import box_read, read_checkpoint
from shardplan.cost.layout import Layout
from shardplan.cost.params import count_params
from shardplan.cost.workload import InferenceWorkload, TrainingWorkload
from shardplan.plan.manifest import write_manifest
from shardplan.plan.placement import model_tensors, rank_holdings
from shardplan.specs.loading import load_model

SPEC = load_model("debug").spec
FP32 = 4
# debug: 5,247,232 parameters; stored as fp32 (its spec's dtype)
CHECKPOINT_TENSOR_BYTES = 5_247_232 * FP32
NORM_ELEMENTS = 8 * 2 * 256 + 256  # two norms per block and the final norm: replicated over tp


def _tensors(dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Distinct values, so a wrong byte range reads the wrong numbers."""
    out, start = {}, 0
    for t in model_tensors(SPEC):
        out[t.name] = (torch.arange(t.numel, dtype=torch.float64) + start).reshape(t.shape).to(dtype)
        start += t.numel
    return out


def _one_file(folder: Path, tensors: dict[str, torch.Tensor] | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors if tensors is not None else _tensors(), str(folder / "model.safetensors"))
    return folder


def _sharded(folder: Path, num_files: int = 3) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    tensors = _tensors()
    names = list(tensors)
    weight_map = {}
    for i in range(num_files):
        rel = f"model-{i + 1:05d}-of-{num_files:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::num_files]}
        save_file(part, str(folder / rel))
        weight_map.update({n: rel for n in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def _plan(tmp_path: Path, gpus: int, layout: Layout, workload=None, gpus_per_node: int | None = None) -> Path:
    m, _ = build_plan("debug", gpus, layout, workload or InferenceWorkload(max_model_len=512, input_len=384, output_len=128), gpus_per_node=gpus_per_node)
    path = tmp_path / "plan.yaml"
    write_manifest(m, path)
    return path


def test_debug_tensor_names_and_shapes_are_transformers_own():
    cfg = AutoConfig.for_model("llama", vocab_size=SPEC.vocab_size, hidden_size=SPEC.hidden_size,
                               intermediate_size=SPEC.intermediate_size, num_hidden_layers=SPEC.num_layers,
                               num_attention_heads=SPEC.num_attention_heads, num_key_value_heads=SPEC.kv_heads,
                               head_dim=SPEC.attention_head_dim, tie_word_embeddings=False)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert {t.name: t.shape for t in model_tensors(SPEC)} == expected


def test_mixtral_names_follow_its_checkpoint():
    spec = load_model("mixtral-8x7b").spec
    tensors = {t.name: t.shape for t in model_tensors(spec)}
    assert tensors["model.layers.0.block_sparse_moe.experts.7.w2.weight"] == (4096, 14336)
    assert tensors["model.layers.31.block_sparse_moe.experts.0.w1.weight"] == (14336, 4096)
    assert tensors["model.layers.0.block_sparse_moe.gate.weight"] == (8, 4096)
    assert sum(np.prod(s) for s in tensors.values()) == count_params(spec).total
    assert len(tensors) == 1 + 32 * (4 + 1 + 8 * 3 + 2) + 2


def test_one_file_loading_plan_adds_up(tmp_path, cli):
    plan = _plan(tmp_path, 8, Layout(tp=2, pp=2, dp=2), gpus_per_node=4)
    ckpt = _one_file(tmp_path / "ckpt")
    r = cli("checkpoint", plan, ckpt, "--json")
    assert r.exit_code == 0, r.stderr
    out = r.json()
    assert out["num_tensors"] == 75 and out["dtype"] == "F32"
    assert out["checkpoint_tensor_bytes"] == CHECKPOINT_TENSOR_BYTES
    # tp-split tensors are read once per replica (dp=2); norms by every tp rank of every replica
    expected_total = 2 * CHECKPOINT_TENSOR_BYTES + 2 * NORM_ELEMENTS * FP32
    assert out["total_read_bytes"] == expected_total == 42_012_672
    per_rank = [rk["bytes"] for rk in out["ranks"]]
    assert sum(per_rank) == expected_total
    assert per_rank == [5_251_072] * 4 + [5_252_096] * 4  # stage 1 has lm_head + the final norm
    assert out["nodes"] == [{"node": 0, "bytes": 4 * 5_251_072}, {"node": 1, "bytes": 4 * 5_252_096}]
    for rk in out["ranks"]:
        for f in rk["files"]:
            assert f["bytes"] == sum(rd["bytes"] for rd in f["reads"])
            assert all(rd["span_bytes"] >= rd["bytes"] for rd in f["reads"])


def test_dp_replicas_each_read_a_full_copy_and_zero3_reads_it_once(tmp_path, cli):
    ckpt = _one_file(tmp_path / "ckpt")
    r = cli("checkpoint", _plan(tmp_path, 4, Layout(dp=4)), ckpt, "--json").json()
    assert [rk["bytes"] for rk in r["ranks"]] == [CHECKPOINT_TENSOR_BYTES] * 4
    assert r["replication"] == 4.0
    train = _plan(tmp_path, 8, Layout(dp=8, zero_stage=3), TrainingWorkload(seq_len=512, global_batch_size=64))
    r = cli("checkpoint", train, ckpt, "--json").json()
    assert r["total_read_bytes"] == CHECKPOINT_TENSOR_BYTES and r["replication"] == 1.0
    assert max(rk["bytes"] for rk in r["ranks"]) - min(rk["bytes"] for rk in r["ranks"]) < 0.01 * CHECKPOINT_TENSOR_BYTES


def test_the_table_gives_ranks_with_the_same_figures_one_row(tmp_path, cli):
    """The table grows with the plan's distinct slices, not its GPUs: 16 data-parallel replicas on two
    nodes are one row; two pipeline stages of tp 2 over 4 replicas, two rows at most per stage."""
    ckpt = _one_file(tmp_path / "ckpt")
    plan = _plan(tmp_path, 16, Layout(dp=16), gpus_per_node=8)
    table = cli("checkpoint", plan, ckpt)
    assert table.exit_code == 0, table.stderr
    rows = [line for line in table.stdout.splitlines() if "MiB" in line and "│" in line]
    assert len(rows) == 1 and "0-15" in rows[0] and "0-1" in rows[0], table.stdout
    assert "per node: nodes 0-1 160.1" in table.stdout and "MiB each;" in table.stdout  # 8 copies of 20.02 MiB each
    staged = _plan(tmp_path, 16, Layout(tp=2, pp=2, dp=4), gpus_per_node=8)
    out = cli("checkpoint", staged, ckpt, "--json").json()
    figures = {(rk["num_tensors"], rk["bytes"]) for rk in out["ranks"]}
    rows = [line for line in cli("checkpoint", staged, ckpt).stdout.splitlines() if "MiB" in line and "│" in line]
    assert 2 <= len(rows) <= 4 and len(figures) <= len(rows) < len(out["ranks"])
    assert any("every" in line or "," in line.split("│")[1] for line in rows)  # a stage's ranks are strided
    assert _rank_set_text([0, 8, 16, 24]) == "0-24 every 8 (4)" and _rank_set_text([3]) == "3"
    assert _rank_set_text([0, 1, 2, 5]) == "0-2, 5"
    assert _rank_set_text([0, 2, 3, 5, 7, 9, 12]) == "7 of 0-12"


def _rank_set_text(xs: list[int]) -> str:
    from shardplan.cli.render_deploy import _rank_set

    return _rank_set(xs)


def test_byte_ranges_read_exactly_the_ranks_slice(tmp_path):
    """Read each rank's ranges from the file and compare with slicing the tensor itself."""
    plan = _plan(tmp_path, 4, Layout(tp=4), gpus_per_node=4)
    from shardplan.plan.manifest import load_manifest

    m = load_manifest(plan)
    tensors = _tensors()
    _, stored, _ = read_checkpoint(_one_file(tmp_path / "ckpt", tensors))
    by_name = {s.name: s for s in stored}
    data = (tmp_path / "ckpt" / "model.safetensors").read_bytes()
    kinds = set()
    for rank, held in enumerate(rank_holdings(m, SPEC)):
        for h in held:
            rd = box_read(by_name[h.tensor.name], h.box)
            got = np.concatenate([np.frombuffer(data, np.float32, rd.length // FP32, rd.start + i * rd.stride)
                                  for i in range(rd.count)])
            want = tensors[h.tensor.name][tuple(slice(a, b) for a, b in h.box)].numpy().ravel()
            np.testing.assert_array_equal(got, want, err_msg=f"rank {rank} {h.tensor.name}")
            kinds.add((rd.count > 1, h.tensor.kind.split.value))
    assert (True, "row") in kinds and (False, "column") in kinds and (False, "kv_column") in kinds


def test_sharded_checkpoint_gives_the_same_totals(tmp_path, cli):
    plan = _plan(tmp_path, 8, Layout(tp=2, pp=2, dp=2), gpus_per_node=4)
    one = cli("checkpoint", plan, _one_file(tmp_path / "one"), "--json").json()
    many = cli("checkpoint", plan, _sharded(tmp_path / "many"), "--json").json()
    assert len(many["files"]) == 3
    assert [rk["bytes"] for rk in many["ranks"]] == [rk["bytes"] for rk in one["ranks"]]
    assert all(len(rk["files"]) == 3 for rk in many["ranks"])  # every file holds some of every stage
    assert sum(f["bytes"] for f in many["files"]) > CHECKPOINT_TENSOR_BYTES  # headers included
    table = cli("checkpoint", plan, tmp_path / "many")
    assert table.exit_code == 0 and "rank" in table.stdout and "20.04 MiB" in table.stdout


def _expect_error(cli, plan, ckpt, *needles, extra=()):
    r = cli("checkpoint", plan, ckpt, *extra)
    assert r.exit_code == 2, r.stdout + r.stderr
    line = r.stderr.strip()
    assert "\n" not in line and "Traceback" not in line
    for n in needles:
        assert n in line, line
    return line


def test_missing_extra_misshaped_and_wrong_dtype_tensors(tmp_path, cli):
    plan = _plan(tmp_path, 2, Layout(tp=2))
    t = _tensors()
    del t["model.layers.3.mlp.up_proj.weight"]
    _expect_error(cli, plan, _one_file(tmp_path / "missing", t), "model.layers.3.mlp.up_proj.weight", "missing")
    t = _tensors()
    t["model.layers.8.mlp.up_proj.weight"] = torch.zeros(4)
    _expect_error(cli, plan, _one_file(tmp_path / "extra", t), "model.safetensors:model.layers.8.mlp.up_proj.weight",
                  "not part of model 'debug'")
    t = _tensors()
    t["model.layers.2.self_attn.k_proj.weight"] = torch.zeros(256, 256)
    _expect_error(cli, plan, _one_file(tmp_path / "shape", t), "k_proj", "[256, 256]", "[128, 256]")
    bf16 = _one_file(tmp_path / "bf16", _tensors(torch.bfloat16))
    _expect_error(cli, plan, bf16, "is BF16, expected F32", "--dtype bf16")
    assert cli("checkpoint", plan, bf16, "--dtype", "bf16", "--json").json()["total_read_bytes"] == \
        5_247_232 * 2 + NORM_ELEMENTS * 2  # bf16; the norms twice (tp=2)


def test_index_entries_may_not_leave_the_folder(tmp_path, cli):
    plan = _plan(tmp_path, 1, Layout())
    ckpt = _sharded(tmp_path / "ckpt")
    index = ckpt / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    name = next(iter(data["weight_map"]))
    for bad in ("../outside.safetensors", "/etc/passwd"):
        data["weight_map"][name] = bad
        index.write_text(json.dumps(data))
        _expect_error(cli, plan, ckpt, "leaves the checkpoint folder", "weight_map")
    (tmp_path / "elsewhere.safetensors").write_bytes(b"")
    (ckpt / "link.safetensors").symlink_to(tmp_path / "elsewhere.safetensors")
    data["weight_map"][name] = "link.safetensors"
    index.write_text(json.dumps(data))
    _expect_error(cli, plan, ckpt, "links outside the checkpoint folder")


def test_a_bundled_source_names_the_catalog_never_a_path(tmp_path, cli):
    """`bundled:` in a plan made by someone else must not reach a file outside the catalog."""
    plan = _plan(tmp_path, 1, Layout())
    (tmp_path / "evil.yaml").write_text(plan.read_text())  # any readable YAML would do
    text = plan.read_text()
    source = next(line for line in text.splitlines() if line.strip().startswith("source:"))
    plan.write_text(text.replace(source, source.split("source:")[0] + f"source: bundled:{tmp_path / 'evil'}"))
    _expect_error(cli, plan, _one_file(tmp_path / "ckpt"), str(plan), "field 'model.source'", "no bundled model")


def test_hostile_headers_are_refused_without_reading_on(tmp_path, cli):
    plan = _plan(tmp_path, 1, Layout())
    (tmp_path / "tb").mkdir()
    (tmp_path / "tb" / "model.safetensors").write_bytes(struct.pack("<Q", 2**40) + b"{}")
    _expect_error(cli, plan, tmp_path / "tb", "header claims 1099511627776 bytes")
    header = json.dumps({"model.norm.weight": {"dtype": "F32", "shape": [256], "data_offsets": [0, 1024]}}).encode()
    (tmp_path / "short").mkdir()
    (tmp_path / "short" / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 16)
    _expect_error(cli, plan, tmp_path / "short", "data_offsets [0, 1024]", "16 bytes of data")
    (tmp_path / "nojson").mkdir()
    (tmp_path / "nojson" / "model.safetensors").write_bytes(struct.pack("<Q", 3) + b"{x}")
    _expect_error(cli, plan, tmp_path / "nojson", "header is not JSON")


def test_models_without_llama_names_are_refused(tmp_path, cli):
    m, _ = build_plan("gpt2", 1, Layout(), InferenceWorkload(max_model_len=1024, input_len=896, output_len=128))
    write_manifest(m, tmp_path / "gpt2.yaml")
    (tmp_path / "ckpt").mkdir()
    _expect_error(cli, tmp_path / "gpt2.yaml", tmp_path / "ckpt", "gpt2.yaml", "model_type 'gpt2'", "fix:")
