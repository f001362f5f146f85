"""`shardplan verify PLAN --checkpoint DIR` for offloaded serving plans (engine transformers).

A small Llama checkpoint is made with transformers' own LlamaConfig and save_pretrained, and
planned from its config.json by shardplan's estimate for the transformers engine with
`offload_layers` set on the layout (neither `estimate` nor `recommend` writes a manifest with
--offload-layers yet, so the manifest is built as tests/exporters/test_export_offload.py builds
it). The consumer tests (`-m consumers`) then run verify for real on the CPU: accelerate loads
the plan's device_map (GPU 0 stood in by torch.device("cpu")), generates and measures. The
checks before anything loads run in the inner loop, on a checkpoint folder whose weights are
never read.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from conftest import build_plan
from shardplan.cost.layout import Layout, Offload
from shardplan.errors import EXIT_BAD_INPUT, EXIT_OK, EXIT_VERIFY_FAILED, EXIT_VERIFY_MISMATCH, ShardplanError
from shardplan.plan.manifest import load_manifest, write_manifest
from shardplan.specs.loading import load_model
from shardplan.verify import offload_compare as oc

HARDWARE = "l4-24gb"
MAX_LEN = 512
# 6 layers, hidden 256: embedding and lm_head 2 MiB each, 1.5 MiB per decoder layer (bf16).
CONFIG = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=4096, hidden_size=256,
              intermediate_size=768, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
              max_position_embeddings=MAX_LEN, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
              hidden_act="silu", torch_dtype="bfloat16")
OFFLOADED = 2  # the last two decoder layers: 4 and 5
QUANTITIES = {"gpu_resident_weights", "gpu_peak_weights", "host_offload", "disk_offload", "moved_per_token"}


def _workload():
    """transformers' generate, as `estimate --engine transformers --enforce-eager --batch-size 1` resolves it."""
    from shardplan.cost.inputs import inference_workload
    from shardplan.knowledge.load import engine_rules
    from shardplan.specs.loading import load_hardware

    return inference_workload(
        max_model_len=MAX_LEN, max_num_seqs=None, max_num_batched_tokens=None, gpu_memory_utilization=None,
        block_size=None, kv_cache_dtype=None, weight_dtype=None, quantization=None, enforce_eager=True,
        input_len=16, output_len=4, batch_size=1, engine=engine_rules("transformers"), hw=load_hardware(HARDWARE),
        model_max_len=MAX_LEN)


def _write_plan(model_dir: Path, path: Path, offload: str = "cpu", layers: int = OFFLOADED) -> Path:
    m, _ = build_plan(str(model_dir / "config.json"), 1, Layout(offload_params=Offload(offload), offload_layers=layers),
                      _workload(), hardware=HARDWARE)
    assert m.predicted.fits, m.predicted.reason
    write_manifest(m, path)
    return path


def _edit(plan: Path, out: Path, edit) -> Path:
    """The plan with one field changed by hand (the manifest's YAML, read and written back)."""
    doc = yaml.safe_load(plan.read_text())
    edit(doc)
    out.write_text(yaml.safe_dump(doc, sort_keys=False))
    return out


def _one_line(r) -> str:
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert not r.stdout
    return lines[0]


# ----- a folder that looks like a checkpoint (its weights are never read) -------------------------


@pytest.fixture
def config_dir(tmp_path) -> Path:
    d = tmp_path / "tiny-llama"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(CONFIG))
    (d / "model.safetensors").write_bytes(b"not read: the checks come first")
    return d


def test_plan_predictions_are_the_plans_own_figures(config_dir, tmp_path):
    """Each prediction is read from the plan as the module says: GPU weights less the streamed
    tensor and the rotary cache, the host bytes, the two offloaded layers' bytes per token."""
    m = load_manifest(_write_plan(config_dir, tmp_path / "plan.yaml"))
    spec = load_model(str(config_dir / "config.json")).spec
    p = oc.predict(m, spec)
    stage = m.predicted.memory.stages[0]
    q_o, k_v, mlp, norms = 2 * 256 * 256, 2 * 256 * (2 * 64), 3 * 256 * 768, 2 * 256
    layer_bytes = 2 * (q_o + k_v + mlp + norms)  # bf16
    largest = 2 * 256 * 768  # one MLP matrix: transformers streams one tensor at a time
    rotary = MAX_LEN * 64 * 2  # positions x rotary_dim x bf16
    assert p.layers == (4, 5)
    assert p.moved_per_token_bytes == OFFLOADED * layer_bytes == p.host_bytes == stage.host_offload_bytes
    assert p.nvme_bytes == 0
    assert (p.streamed_buffer_bytes, p.rotary_cache_bytes) == (largest, rotary)
    assert p.gpu_resident_bytes == stage.per_gpu_bytes["weights"] - largest - rotary
    assert p.gpu_peak_bytes == p.gpu_resident_bytes + largest


def test_comparison_holds_each_quantity_to_five_percent(config_dir, tmp_path):
    m = load_manifest(_write_plan(config_dir, tmp_path / "plan.yaml"))
    run = oc.prepare(m, plan="plan.yaml", checkpoint=config_dir, prompt_len=5, new_tokens=4)
    p = run.prediction
    exact = oc.OffloadMeasurement(gpu_resident_bytes=p.gpu_resident_bytes, gpu_peak_bytes=p.gpu_peak_bytes,
                                  host_bytes=p.host_bytes, disk_bytes=0, moved_bytes_total=4 * p.moved_per_token_bytes,
                                  forwards=4, tokens=(1, 2, 3), reference_tokens=(1, 2, 3))
    ok = oc.compare(run, exact)
    assert ok.status == "ok" and {q.quantity for q in ok.quantities} == QUANTITIES and not ok.mismatches
    assert ok.offloaded_modules == ["model.layers.4", "model.layers.5"]
    inside = oc.compare(run, oc.OffloadMeasurement(**{**exact.__dict__, "host_bytes": p.host_bytes * 1.049}))
    assert inside.status == "ok"
    outside = oc.compare(run, oc.OffloadMeasurement(**{**exact.__dict__, "host_bytes": p.host_bytes * 1.051,
                                                       "disk_bytes": 1}))
    assert outside.status == "mismatch"
    assert [q.quantity for q in outside.quantities if not q.ok] == ["host_offload", "disk_offload"]
    assert outside.mismatches[0].startswith("host_offload (cpu): measured")
    differ = oc.compare(run, oc.OffloadMeasurement(**{**exact.__dict__, "tokens": (1, 2, 4)}))
    assert differ.status == "mismatch" and not differ.numerics.ok and differ.mismatches[0].startswith("numerics")


def test_plan_spec_falls_back_to_a_checkpoint_config_that_is_the_plans_model(config_dir, tmp_path):
    m = load_manifest(_write_plan(config_dir, tmp_path / "plan.yaml"))
    elsewhere = tmp_path / "copy"
    elsewhere.mkdir()
    (elsewhere / "config.json").write_text((config_dir / "config.json").read_text())
    found = load_model(str(elsewhere / "config.json")).spec
    (config_dir / "config.json").unlink()  # the plan's source is gone
    spec = oc.plan_model_spec(m, found, "plan.yaml", str(elsewhere))
    assert spec.name == m.model.name and spec.hidden_size == 256
    other = found.model_copy(update={"intermediate_size": 1024})
    with pytest.raises(ShardplanError) as e:
        oc.plan_model_spec(m, other, "plan.yaml", str(elsewhere))
    assert e.value.field == "model.spec_sha256"


# ----- bad input: one line, exit 2, before anything loads ------------------------------------------


def test_missing_checkpoint_is_one_line(cli, config_dir, tmp_path):
    plan = _write_plan(config_dir, tmp_path / "plan.yaml")
    r = cli("verify", plan, "--checkpoint", tmp_path / "nowhere")
    assert r.exit_code == EXIT_BAD_INPUT
    assert "no such checkpoint folder" in _one_line(r) and "--checkpoint" in r.stderr


def test_checkpoint_without_safetensors_is_one_line(cli, config_dir, tmp_path):
    plan = _write_plan(config_dir, tmp_path / "plan.yaml")
    (config_dir / "model.safetensors").unlink()
    r = cli("verify", plan, "--checkpoint", config_dir)
    assert r.exit_code == EXIT_BAD_INPUT and "no *.safetensors" in _one_line(r)


def test_checkpoint_of_another_model_is_one_line(cli, config_dir, tmp_path):
    plan = _write_plan(config_dir, tmp_path / "plan.yaml")
    other = tmp_path / "wider"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({**CONFIG, "hidden_size": 512}))
    (other / "model.safetensors").write_bytes(b"x")
    r = cli("verify", plan, "--checkpoint", other)
    assert r.exit_code == EXIT_BAD_INPUT
    line = _one_line(r)
    assert "field 'hidden_size'" in line and "512" in line and "256" in line


@pytest.mark.parametrize("edit,field", [
    (lambda d: d["layout"].update(offload_params="none", offload_layers=0), "layout.offload_layers"),
    (lambda d: d["workload"].update(engine="vllm", engine_version=None), "workload.engine"),
    (lambda d: d["workload"].update(quantization="int8"), "workload.quantization"),
])
def test_a_plan_that_is_not_offloaded_transformers_serving_is_one_line(cli, config_dir, tmp_path, edit, field):
    plan = _edit(_write_plan(config_dir, tmp_path / "plan.yaml"), tmp_path / "edited.yaml", edit)
    r = cli("verify", plan, "--checkpoint", config_dir)
    assert r.exit_code == EXIT_BAD_INPUT
    assert f"field '{field}'" in _one_line(r)


def test_an_offload_folder_that_cannot_be_written_is_one_line(cli, config_dir, tmp_path):
    plan = _write_plan(config_dir, tmp_path / "plan.yaml", "nvme")
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    r = cli("verify", plan, "--checkpoint", config_dir, "--offload-folder", blocker / "offload")
    assert r.exit_code == EXIT_BAD_INPUT
    line = _one_line(r)
    assert "offload folder" in line and "cannot be written" in line and "--offload-folder" in line


@pytest.mark.parametrize("extra,flag", [
    (("--offload-folder", "x"), "--offload-folder"),  # a cpu plan writes nothing to disk
    (("--scale", "full"), "--scale"),
    (("--dtype", "fp32"), "--dtype"),
])
def test_options_that_do_not_apply_are_one_line(cli, config_dir, tmp_path, extra, flag):
    plan = _write_plan(config_dir, tmp_path / "plan.yaml")
    r = cli("verify", plan, "--checkpoint", config_dir, *extra)
    assert r.exit_code == EXIT_BAD_INPUT and f"field '{flag}'" in _one_line(r)


def test_offload_folder_without_checkpoint_is_one_line(cli, config_dir, tmp_path):
    plan = _write_plan(config_dir, tmp_path / "plan.yaml", "nvme")
    r = cli("verify", plan, "--offload-folder", tmp_path)
    assert r.exit_code == EXIT_BAD_INPUT and "applies to --checkpoint only" in _one_line(r)


def test_an_offloaded_plan_without_checkpoint_is_sent_to_it(cli, config_dir, tmp_path):
    """The torchrun path does not run an offloaded serving plan: it names --checkpoint."""
    plan = _write_plan(config_dir, tmp_path / "plan.yaml")
    r = cli("verify", plan)
    assert r.exit_code == EXIT_BAD_INPUT
    line = _one_line(r)
    assert "field 'layout.offload_params'" in line and "--checkpoint DIR" in line


def test_a_missing_accelerate_is_one_line(cli, config_dir, tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "accelerate" else real(name, *a))
    r = cli("verify", _write_plan(config_dir, tmp_path / "plan.yaml"), "--checkpoint", config_dir)
    assert r.exit_code == EXIT_BAD_INPUT
    assert "accelerate is not installed" in _one_line(r) and "pip install accelerate" in r.stderr


# ----- run for real (accelerate and transformers on the CPU) ----------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """CONFIG as a seeded transformers Llama in bf16, saved as safetensors."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = {k: v for k, v in CONFIG.items() if k not in ("architectures", "model_type", "torch_dtype")}
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).to(torch.bfloat16).eval()
    d = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(d, safe_serialization=True)
    return d


def _layer_bytes_in_checkpoint(ckpt: Path, layers) -> int:
    """The offloaded layers' bytes as the safetensors file stores them (read independently of verify)."""
    from safetensors import safe_open

    total = 0
    with safe_open(str(next(ckpt.glob("*.safetensors"))), framework="pt") as f:
        for name in f.keys():
            if any(name.startswith(f"model.layers.{i}.") for i in layers):
                t = f.get_slice(name)
                total += math.prod(t.get_shape()) * 2  # bf16
    return total


def _verify(cli, plan: Path, ckpt: Path, *extra):
    r = cli("verify", plan, "--checkpoint", ckpt, "--json", *extra)
    report = r.json() if r.stdout else None
    if report:
        print(f"\n{plan.name}: " + "; ".join(
            f"{q['quantity']} measured {q['measured_bytes']:,.0f} B, predicted {q['predicted_bytes']:,.0f} B"
            + (f" ({q['relative_error']:+.3%})" if q["relative_error"] is not None else "")
            for q in report["quantities"]))
    return r, report


@pytest.mark.consumers
@pytest.mark.parametrize("offload,held,empty", [("cpu", "host_offload", "disk_offload"),
                                                ("nvme", "disk_offload", "host_offload")])
def test_offloaded_plan_verifies_within_five_percent(cli, checkpoint, tmp_path, offload, held, empty):
    plan = _write_plan(checkpoint, tmp_path / f"plan-{offload}.yaml", offload)
    folder = tmp_path / "nvme"
    r, report = _verify(cli, plan, checkpoint, *(("--offload-folder", folder) if offload == "nvme" else ()))
    assert r.exit_code == EXIT_OK, r.stderr
    assert report["status"] == "ok" and not report["mismatches"]
    rows = {q["quantity"]: q for q in report["quantities"]}
    assert set(rows) == QUANTITIES and all(q["ok"] for q in rows.values())
    assert report["numerics"]["ok"] and report["numerics"]["tokens"] == report["numerics"]["reference_tokens"]
    assert len(report["numerics"]["tokens"]) == report["numerics"]["prompt_tokens"] + 4 and report["forwards"] == 4
    offloaded = _layer_bytes_in_checkpoint(checkpoint, (4, 5))
    assert rows[held]["measured_bytes"] == offloaded and rows[empty]["measured_bytes"] == 0
    assert rows["moved_per_token"]["measured_bytes"] == offloaded  # every forward brings both layers in, once
    assert report["moved_bytes_total"] == 4 * offloaded
    # the GPU holds all but the offloaded layers; while generating, one more tensor at most
    assert rows["gpu_peak_weights"]["measured_bytes"] > rows["gpu_resident_weights"]["measured_bytes"]
    assert report["offloaded_modules"] == ["model.layers.4", "model.layers.5"]
    if offload == "nvme":
        assert folder.is_dir() and not any(folder.iterdir())  # the run's own folder, removed after


@pytest.mark.consumers
def test_the_table_shows_measured_against_predicted(cli, checkpoint, tmp_path):
    plan = _write_plan(checkpoint, tmp_path / "plan.yaml")
    r = cli("verify", plan, "--checkpoint", checkpoint, "--report", tmp_path / "report.json")
    assert r.exit_code == EXIT_OK, r.stderr
    saved = json.loads((tmp_path / "report.json").read_text())  # --report: the object --json prints
    assert saved["kind"] == "offload_serving" and {q["quantity"] for q in saved["quantities"]} == QUANTITIES
    for quantity in QUANTITIES:
        assert quantity in r.stdout
    assert f"{_layer_bytes_in_checkpoint(checkpoint, (4, 5)):,}" in r.stdout
    assert "numerics" in r.stdout and "match" in r.stdout


@pytest.mark.consumers
def test_a_plan_offloading_other_layers_than_it_predicts_exits_4(cli, checkpoint, tmp_path):
    """The plan's offload_layers says 3 while its predictions were made for 2: the device_map
    loads 3 layers off the GPU, and the bytes no longer match."""
    plan = _edit(_write_plan(checkpoint, tmp_path / "plan.yaml"), tmp_path / "three.yaml",
                 lambda d: d["layout"].update(offload_layers=3))
    r, report = _verify(cli, plan, checkpoint)
    assert r.exit_code == EXIT_VERIFY_MISMATCH, r.stderr
    bad = {q["quantity"] for q in report["quantities"] if not q["ok"]}
    assert {"host_offload", "gpu_resident_weights", "gpu_peak_weights"} <= bad
    assert any(m.startswith("host_offload (cpu)") for m in report["mismatches"])


@pytest.mark.consumers
@pytest.mark.parametrize("offload,key,quantity", [("cpu", "host_offload_bytes", "host_offload"),
                                                  ("nvme", "nvme_offload_bytes", "disk_offload")])
def test_a_tampered_prediction_exits_4_naming_it(cli, checkpoint, tmp_path, offload, key, quantity):
    def tamper(d):
        d["predicted"]["memory"]["stages"][0][key] *= 1.2

    plan = _edit(_write_plan(checkpoint, tmp_path / "plan.yaml", offload), tmp_path / "tampered.yaml", tamper)
    r, report = _verify(cli, plan, checkpoint)
    assert r.exit_code == EXIT_VERIFY_MISMATCH, r.stderr
    assert [q["quantity"] for q in report["quantities"] if not q["ok"]] == [quantity]
    r = cli("verify", plan, "--checkpoint", checkpoint)
    assert r.exit_code == EXIT_VERIFY_MISMATCH and f"out of tolerance: {quantity}" in r.stdout


@pytest.mark.consumers
def test_tokens_that_differ_from_the_whole_model_exit_4(cli, checkpoint, tmp_path, monkeypatch):
    from shardplan.verify import offload_serving

    monkeypatch.setattr(offload_serving, "_reference_tokens", lambda run: (*run.prompt, 0, 0, 0, 0))
    r, report = _verify(cli, _write_plan(checkpoint, tmp_path / "plan.yaml"), checkpoint)
    assert r.exit_code == EXIT_VERIFY_MISMATCH
    assert not report["numerics"]["ok"] and report["mismatches"][-1].startswith("numerics")


@pytest.mark.consumers
def test_a_checkpoint_that_does_not_load_exits_5(cli, checkpoint, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((checkpoint / "config.json").read_text())
    (broken / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    plan = _write_plan(broken, tmp_path / "plan.yaml")
    r = cli("verify", plan, "--checkpoint", broken)
    assert r.exit_code == EXIT_VERIFY_FAILED
    assert "the offloaded run failed" in _one_line(r)

