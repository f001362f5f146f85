"""Exports of offloaded and quantized serving plans, loaded as planned.

A small Llama-style checkpoint is made here (transformers' own LlamaConfig and save_pretrained),
shardplan plans it from its config.json (the same estimate `shardplan recommend` runs, for a
pinned layout and the transformers engine's rules) and the export task `shardplan export -o`
runs writes the accelerate files. The consumer tests (`-m consumers`) then load it on the CPU with accelerate and
bitsandbytes and measure, per device, the bytes accelerate holds against the bytes the plan
predicted (within 5%):

- GPU 0 does not exist here. Its device-map entries are loaded on `torch.device("cpu")`, which
  accelerate treats as a device of its own, distinct from the "cpu" offload target
  (dispatch_model: main device = the first value not "cpu"/"disk"), so "cpu" entries really go
  through accelerate's offload hooks into its weights_map, and "disk" entries into
  offload_folder, exactly as beside a GPU. What the "GPU" holds is the parameters left
  materialized on the model; what the host holds is the weights_map's tensors; what the disk
  holds is the .dat files in offload_folder.
- An offloaded module's weights are copied to the execution device for its forward and
  dropped after: the peak of materialized weight bytes during generation is measured too.
- int8 is bitsandbytes LLM.int8 on its CPU backend (bitsandbytes >= 0.46), quantized by
  transformers at load from the exported quantization_config.json, through the exported load.py.

The plans come from shardplan's estimate with `offload_layers` set on the layout: the CLI's
`--offload-layers` option is not there yet (when it lands, build them with the CLI).
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import build_plan
from shardplan.cost.layout import Layout, Offload
from shardplan.exporters import CannotExpress, ExportOptions, export
from shardplan.exporters.base import GIB, argv, flag_table
from shardplan.plan.manifest import write_manifest
from shardplan.specs.loading import load_model

TOLERANCE = 0.05  # the must-hold: bytes per device within 5% of the plan's
HARDWARE = "l4-24gb"
MAX_LEN = 512
# A Llama of 6 layers, hidden 256: embedding and lm_head 2 MiB each, 1.6 MB per decoder layer (bf16).
# (bitsandbytes' CPU 4-bit kernels need output rows in multiples of its block: intermediate 768.)
CONFIG = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=4096, hidden_size=256,
              intermediate_size=768, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
              max_position_embeddings=MAX_LEN, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
              hidden_act="silu", torch_dtype="bfloat16")


def transformers_workload(quantization: str | None = None):
    """Serving with transformers' generate (the engine accelerate exports are sized for): the same
    resolution `shardplan recommend --engine transformers --enforce-eager --batch-size 1` makes."""
    from shardplan.cost.inputs import inference_workload
    from shardplan.knowledge.load import engine_rules
    from shardplan.specs.loading import load_hardware

    return inference_workload(
        max_model_len=MAX_LEN, max_num_seqs=None, max_num_batched_tokens=None, gpu_memory_utilization=None,
        block_size=None, kv_cache_dtype=None, weight_dtype=None, quantization=quantization, enforce_eager=True,
        input_len=16, output_len=4, batch_size=1, engine=engine_rules("transformers"), hw=load_hardware(HARDWARE),
        model_max_len=MAX_LEN)


def plan(model_dir: Path, offload: str = "none", layers: int = 0, quantization: str | None = None):
    layout = Layout(offload_params=Offload(offload), offload_layers=layers)
    m, _ = build_plan(str(model_dir), 1, layout, transformers_workload(quantization), hardware=HARDWARE)
    assert m.predicted.fits, m.predicted.reason
    return m


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The model's config.json alone: what shardplan plans from."""
    d = tmp_path_factory.mktemp("tiny-llama-config")
    (d / "config.json").write_text(json.dumps(CONFIG))
    return d


def files(m, model_dir: Path, target: str = "accelerate") -> dict[str, str]:
    spec = load_model(str(model_dir / "config.json")).spec
    return {f.name: f.text for f in export(m, target, spec=spec, options=ExportOptions())}


def gib(text: str) -> float:
    """A max_memory entry back in bytes, as accelerate's convert_file_size_to_int reads "...GiB"."""
    match = re.fullmatch(r"([0-9.]+)GiB", text)
    assert match, text
    return float(match.group(1)) * GIB


# ----- what the exports say (no torch) ----------------------------------------------------------


@pytest.mark.parametrize("offload,placed", [("cpu", "cpu"), ("nvme", "disk")])
def test_offloaded_plan_maps_the_last_layers_off_the_gpu_with_max_memory(model_dir, offload, placed):
    m = plan(model_dir, offload, 2)
    out = files(m, model_dir)
    assert set(out) == {"device_map.json", "load.py", "README.txt"}
    doc = json.loads(out["device_map.json"])
    dmap = doc["device_map"]
    assert {k: v for k, v in dmap.items() if k.startswith("model.layers.")} == {
        f"model.layers.{i}": 0 if i < 4 else placed for i in range(6)}
    assert dmap["model.embed_tokens"] == dmap["model.norm"] == dmap["lm_head"] == 0
    stage = m.predicted.memory.stages[0]
    mm = {k: gib(v) for k, v in doc["max_memory"].items()}
    assert set(mm) == {"0", "cpu"}
    # the cap admits the plan's bytes, with the margin and the 0.001 GiB rounding, and no more
    assert stage.per_gpu_bytes["weights"] * 1.05 <= mm["0"] < stage.per_gpu_bytes["weights"] * 1.05 + GIB / 1000
    if offload == "cpu":
        assert stage.host_offload_bytes > 0 and stage.nvme_offload_bytes == 0
        assert stage.host_offload_bytes * 1.05 <= mm["cpu"] < stage.host_offload_bytes * 1.05 + GIB / 1000
        assert "offload_folder" not in doc
    else:
        assert stage.nvme_offload_bytes > 0 and stage.host_offload_bytes == 0
        assert doc["offload_folder"] == "offload"
        assert mm["cpu"] < stage.nvme_offload_bytes  # one layer in flight, not the disk's share
        assert "DISK_BYTES = %d" % int(stage.nvme_offload_bytes) in out["load.py"]
    compile(out["load.py"], "load.py", "exec")


def test_shardplan_export_writes_the_offload_files(model_dir, tmp_path, cli):
    path = tmp_path / "plan.yaml"
    write_manifest(plan(model_dir, "nvme", 2, "int8"), path)
    r = cli("export", path, "--to", "accelerate", "-o", tmp_path / "out", "--json")
    assert r.exit_code == 0, r.stderr
    names = {Path(f["path"]).name for f in r.json()["files"]}
    assert names == {"device_map.json", "quantization_config.json", "load.py", "README.txt"}
    doc = json.loads((tmp_path / "out" / "device_map.json").read_text())
    assert doc["offload_folder"] == "offload" and set(doc["max_memory"]) == {"0", "cpu"}


def test_plain_plan_exports_as_before(model_dir):
    out = files(plan(model_dir), model_dir)
    assert set(out) == {"device_map.json", "README.txt"}
    assert set(json.loads(out["device_map.json"])) == {"device_map", "no_split_module_classes"}


@pytest.mark.parametrize("quantization,offload", [("int8", False), ("int8", True), ("nf4", False), ("nf4", True)])
def test_bitsandbytes_plan_exports_its_quantization_config(model_dir, quantization, offload):
    m = plan(model_dir, "cpu" if offload else "none", 2 if offload else 0, quantization)
    out = files(m, model_dir)
    assert {"quantization_config.json", "load.py"} <= set(out)
    cfg = json.loads(out["quantization_config.json"])
    assert cfg["quant_method"] == "bitsandbytes"
    assert (cfg["load_in_8bit"], cfg["load_in_4bit"]) == ((True, False) if quantization == "int8" else (False, True))
    assert cfg["llm_int8_enable_fp32_cpu_offload"] is offload
    if quantization == "nf4":
        assert (cfg["bnb_4bit_quant_type"], cfg["bnb_4bit_compute_dtype"]) == ("nf4", "bfloat16")
        assert cfg["bnb_4bit_use_double_quant"] is False  # as shardplan counts nf4: an fp32 absmax per 64
    assert "BitsAndBytesConfig.from_dict(cfg)" in out["load.py"]
    if offload:
        assert "stay unquantized" in out["README.txt"]
        # the host holds the offloaded layers 16-bit: max_memory counts them so, not at the plan's format
        host = gib(json.loads(out["device_map.json"])["max_memory"]["cpu"])
        dense = plan(model_dir, "cpu", 2).predicted.memory.stages[0].host_offload_bytes
        assert host >= dense * 1.05 / 0.90


@pytest.mark.parametrize("quantization", ["awq", "gptq", "fp8"])
def test_prequantized_plan_exports_no_quantization_config(model_dir, quantization):
    out = files(plan(model_dir, quantization=quantization), model_dir)
    assert "quantization_config.json" not in out
    assert "carries its quantization_config" in out["README.txt"]


def test_gguf_plan_is_refused_by_accelerate(model_dir):
    m = plan(model_dir, quantization="q4_k_m")
    with pytest.raises(CannotExpress) as e:
        files(m, model_dir)
    assert e.value.field == "workload.quantization" and "llamacpp" in e.value.hint


# ----- vLLM --cpu-offload-gb -----------------------------------------------------------------


def vllm_plan(offload: str, layers: int):
    """Llama 3.1 8B on a 24 GB L4 with `layers` decoder layers offloaded, by vLLM's rules."""
    from shardplan.cost.inputs import inference_workload
    from shardplan.knowledge.load import engine_rules
    from shardplan.specs.loading import load_hardware

    wl = inference_workload(max_model_len=8192, max_num_seqs=None, max_num_batched_tokens=None,
                            gpu_memory_utilization=None, block_size=None, kv_cache_dtype=None, weight_dtype=None,
                            quantization=None, enforce_eager=False, input_len=1024, output_len=128, batch_size=None,
                            engine=engine_rules("vllm"), hw=load_hardware(HARDWARE), model_max_len=8192)
    m, _ = build_plan("llama-3.1-8b", 1, Layout(offload_params=Offload(offload), offload_layers=layers), wl,
                 hardware=HARDWARE)
    return m


def serve_argv(m) -> list[str]:
    text = export(m, "vllm", spec=load_model("llama-3.1-8b").spec)[0].text
    return argv(text[text.index("vllm serve"):])


def test_vllm_export_offloads_the_plans_host_bytes_in_gib():
    m = vllm_plan("cpu", 8)
    host = m.predicted.memory.stages[0].host_offload_bytes
    assert host > 0
    args = serve_argv(m)
    value = float(args[args.index("--cpu-offload-gb") + 1])
    # vLLM offloads int(cpu_offload_gb * 1024**3) bytes: at least the plan's, by less than 0.01 GiB more
    assert host <= value * 1024**3 < host + 0.01 * 1024**3
    for version in ("vllm-0.33.0", "vllm-0.11.0"):  # the flag is in both pinned lists
        assert "cpu-offload-gb" in flag_table(version).flags


def test_vllm_export_without_offload_has_no_cpu_offload_flag():
    assert "--cpu-offload-gb" not in serve_argv(vllm_plan("none", 0))


def test_vllm_refuses_disk_offload():
    m = vllm_plan("nvme", 8)
    with pytest.raises(CannotExpress) as e:
        serve_argv(m)
    assert e.value.field == "layout.offload_params" and "no disk offload" in str(e.value)


# ----- loaded with accelerate and bitsandbytes on the CPU ---------------------------------------


def _write_exports(m, model_dir: Path, out: Path) -> Path:
    """The plan written as a manifest and exported by the export task `shardplan export -o` runs."""
    from shardplan.tasks.export import export_plan

    out.mkdir(parents=True)
    path = out / "plan.yaml"
    write_manifest(m, path)
    export_plan(path, "accelerate", ExportOptions(plan_file=str(path)), out)
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """CONFIG as a seeded transformers Llama in bf16, saved as safetensors, with its greedy tokens."""
    import accelerate
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = {k: v for k, v in CONFIG.items() if k not in ("architectures", "model_type", "torch_dtype")}
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).to(torch.bfloat16).eval()
    d = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(d, safe_serialization=True)
    ids = torch.tensor([[1, 17, 300, 4000, 5]])
    whole = _empty(d)  # built and loaded as the offloaded ones are, so that only the offload differs
    accelerate.load_checkpoint_in_model(whole, str(d), device_map={"": "cpu"}, dtype="bfloat16")
    with torch.no_grad():
        tokens = whole.eval().generate(ids, max_new_tokens=4, do_sample=False)
    return d, ids, tokens


def _empty(ckpt: Path):
    import accelerate
    import transformers

    with accelerate.init_empty_weights():
        return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(ckpt),
                                                             dtype="bfloat16")


GPU_STAND_IN = "GPU 0 loaded on torch.device('cpu')"


def _stand_in(device_map: dict) -> dict:
    import torch

    return {k: torch.device("cpu") if isinstance(v, int) else v for k, v in device_map.items()}


def _nbytes(tensors) -> int:
    """Bytes of the tensors, with the per-row scales bitsandbytes keeps beside an int8 weight (SCB)."""
    total = 0
    for t in tensors:
        total += t.numel() * t.element_size()
        scb = getattr(t, "SCB", None)
        total += scb.numel() * scb.element_size() if scb is not None else 0
    return total


def _held(model, offload_folder: Path | None) -> dict[str, int]:
    """Bytes per device: parameters left materialized ("gpu"), accelerate's weights_map ("cpu"),
    the .dat files it wrote into offload_folder ("disk")."""
    loaders = {id(h.weights_map.dataset): h.weights_map.dataset for mod in model.modules()
               if (h := getattr(mod, "_hf_hook", None)) is not None and getattr(h, "offload", False)
               and h.weights_map is not None}
    cpu = sum(_nbytes(ds.state_dict.values()) for ds in loaders.values())
    disk = sum(f.stat().st_size for f in offload_folder.glob("*.dat")) if offload_folder and offload_folder.is_dir() else 0
    return {"gpu": _nbytes(p for p in model.parameters() if p.device.type != "meta"), "cpu": cpu, "disk": disk}


def _generate_measuring_peak(model, ids):
    """Greedy tokens, and the most weight bytes materialized at any matrix product or embedding
    lookup: the GPU's weights while offloaded modules are brought in for their forward."""
    import torch
    from torch.overrides import TorchFunctionMode

    peak = [0]
    watched = {torch.nn.functional.linear, torch.nn.functional.embedding}

    class Peak(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in watched:
                peak[0] = max(peak[0], _nbytes(p for p in model.parameters() if p.device.type != "meta"))
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), Peak():
        tokens = model.generate(ids, max_new_tokens=4, do_sample=False)
    return tokens, peak[0]


def _streamed_layer_bytes(m) -> float:
    """The one offloaded layer the plan counts on the GPU while it runs (cost/offload.py)."""
    from shardplan.cost.offload import offload_memory
    from shardplan.plan.readback import plan_layout, plan_workload, plan_spec

    return offload_memory(plan_spec(m), plan_layout(m), plan_workload(m)).streamed_buffer_bytes


def _within(measured: float, predicted: float) -> bool:
    return abs(measured - predicted) <= TOLERANCE * predicted


def _report(name: str, rows: dict[str, tuple[float, float]]) -> None:
    print(f"\n{name}: " + "; ".join(f"{k} measured {a:,.0f} B, planned {b:,.0f} B ({(a - b) / b:+.2%})"
                                     for k, (a, b) in rows.items() if b))


@pytest.mark.consumers
@pytest.mark.parametrize("offload,where", [("cpu", "cpu"), ("nvme", "disk")])
def test_offloaded_export_loads_in_accelerate_holding_the_planned_bytes(checkpoint, tmp_path, offload, where):
    import accelerate

    ckpt, ids, expected = checkpoint
    m = plan(ckpt, offload, 2)
    out = _write_exports(m, ckpt, tmp_path / "export")
    doc = json.loads((out / "device_map.json").read_text())
    folder = tmp_path / doc.get("offload_folder", "offload")
    empty = _empty(ckpt)
    # load_checkpoint_and_dispatch in its two steps: safetensors opens tensors on a device named by
    # a string, so the GPU's modules load on "cpu"; dispatch then runs with the stand-in device
    accelerate.load_checkpoint_in_model(
        empty, str(ckpt), device_map={k: "cpu" if isinstance(v, int) else v for k, v in doc["device_map"].items()},
        offload_folder=str(folder) if where == "disk" else None, offload_state_dict=where == "disk", dtype="bfloat16")
    model = accelerate.dispatch_model(empty, device_map=_stand_in(doc["device_map"]),
                                      offload_dir=str(folder) if where == "disk" else None)
    held = _held(model, folder)
    tokens, peak = _generate_measuring_peak(model, ids)
    assert tokens.tolist() == expected.tolist()  # offloaded, the model computes what it computed whole

    stage = m.predicted.memory.stages[0]
    gpu_weights = stage.per_gpu_bytes["weights"]
    resident_planned = gpu_weights - _streamed_layer_bytes(m)
    off_planned = stage.host_offload_bytes if where == "cpu" else stage.nvme_offload_bytes
    _report(f"{offload} offload ({GPU_STAND_IN})", {
        "GPU resident": (held["gpu"], resident_planned), "GPU peak": (peak, gpu_weights), where: (held[where], off_planned)})
    assert _within(held["gpu"], resident_planned)
    assert _within(held[where], off_planned)
    assert held["disk" if where == "cpu" else "cpu"] == 0
    # accelerate brings offloaded weights in module by module (a hook per module with parameters):
    # the peak is the resident bytes and the largest offloaded Linear, as the plan counts it
    assert held["gpu"] < peak and _within(peak, gpu_weights)


@pytest.mark.consumers
def test_disk_offloaded_export_loads_through_load_py(checkpoint, tmp_path):
    """transformers >= 5 reads a safetensors checkpoint's disk layers in place: its offload index
    points into the checkpoint, and those tensors are the plan's NVMe bytes. (GPU 0's entries load
    on "cpu": transformers opens safetensors on a device named by a string.)"""
    ckpt, ids, expected = checkpoint
    m = plan(ckpt, "nvme", 2)
    out = _write_exports(m, ckpt, tmp_path / "export")
    load = _import_load_py(out)
    dmap = {k: "cpu" if isinstance(v, int) else v for k, v in load.exported()["device_map"].items()}
    folder = tmp_path / "offload"
    model = load.load(model=str(ckpt), device_map=dmap, offload_folder=str(folder))
    loaders = {id(h.weights_map.dataset): h.weights_map.dataset for mod in model.modules()
               if (h := getattr(mod, "_hf_hook", None)) is not None and getattr(h, "offload", False)}
    index = {k: v for ds in loaders.values() for k, v in ds.index.items()}
    assert {Path(v["safetensors_file"]).parent for v in index.values()} == {ckpt}
    on_disk = sum(math.prod(ds[k].shape) * ds[k].element_size() for ds in loaders.values() for k in ds.index)
    planned = m.predicted.memory.stages[0].nvme_offload_bytes
    _report("nvme offload through load.py", {"disk": (on_disk, planned)})
    assert _within(on_disk, planned)
    tokens, _ = _generate_measuring_peak(model, ids)
    assert tokens.tolist() == expected.tolist()


@pytest.mark.consumers
@pytest.mark.parametrize("quantization", ["int8", "nf4"])
def test_bitsandbytes_export_loads_holding_the_planned_bytes(checkpoint, tmp_path, quantization):
    pytest.importorskip("bitsandbytes", reason="bitsandbytes (CPU backend >= 0.46) quantizes at load")
    import bitsandbytes as bnb

    ckpt, ids, _ = checkpoint
    m = plan(ckpt, quantization=quantization)
    out = _write_exports(m, ckpt, tmp_path / "export")
    load = _import_load_py(out)
    doc = json.loads((out / "device_map.json").read_text())
    model = load.load(model=str(ckpt), device_map={k: "cpu" for k in doc["device_map"]})  # GPU 0 -> "cpu"
    kind = bnb.nn.Linear8bitLt if quantization == "int8" else bnb.nn.Linear4bit
    assert all(isinstance(getattr(layer.mlp, p), kind) for layer in model.model.layers for p in ("gate_proj", "down_proj"))
    assert not isinstance(model.lm_head, kind)  # transformers keeps the output layer 16-bit, as shardplan counts it
    # as loaded (bitsandbytes' CPU 4-bit kernels repack the weights at their first forward): int8
    # weights and an fp32 SCB per row; nf4: packed 4-bit pairs, an fp32 absmax per 64 weights and
    # the 16-value code; the rest 16-bit
    measured = _nbytes(model.state_dict().values())
    tokens, _ = _generate_measuring_peak(model, ids)
    assert tokens.shape == (1, ids.shape[1] + 4)
    planned = m.predicted.memory.stages[0].per_gpu_bytes["weights"]
    _report(f"{quantization} (bitsandbytes on the CPU)", {"GPU": (measured, planned)})
    assert _within(measured, planned)


@pytest.mark.consumers
def test_int8_offloaded_export_keeps_the_offloaded_layers_16_bit(checkpoint, tmp_path):
    """transformers with llm_int8_enable_fp32_cpu_offload: the GPU's linears int8, the offloaded
    layers unquantized in the host's weights_map, the bytes the export's max_memory counts."""
    pytest.importorskip("bitsandbytes", reason="bitsandbytes (CPU backend >= 0.46) quantizes at load")
    import bitsandbytes as bnb

    ckpt, ids, _ = checkpoint
    m = plan(ckpt, "cpu", 2, "int8")
    out = _write_exports(m, ckpt, tmp_path / "export")
    load = _import_load_py(out)
    doc = json.loads((out / "device_map.json").read_text())
    model = load.load(model=str(ckpt), device_map=_stand_in(doc["device_map"]))
    assert isinstance(model.model.layers[3].mlp.down_proj, bnb.nn.Linear8bitLt)
    assert not isinstance(model.model.layers[5].mlp.down_proj, bnb.nn.Linear8bitLt)
    held = _held(model, None)
    tokens, _ = _generate_measuring_peak(model, ids)
    assert tokens.shape == (1, ids.shape[1] + 4)
    stage = m.predicted.memory.stages[0]
    dense_host = plan(ckpt, "cpu", 2).predicted.memory.stages[0].host_offload_bytes  # the same layers, bf16
    resident_planned = stage.per_gpu_bytes["weights"] - _streamed_layer_bytes(m)
    _report(f"int8 + cpu offload ({GPU_STAND_IN})", {
        "GPU resident": (held["gpu"], resident_planned), "cpu": (held["cpu"], stage.host_offload_bytes),
        "cpu vs bf16 layers": (held["cpu"], dense_host)})
    assert _within(held["gpu"], resident_planned)
    assert _within(held["cpu"], dense_host)
    assert gib(doc["max_memory"]["cpu"]) >= held["cpu"]


@pytest.mark.consumers
def test_int8_offloaded_plan_predicts_the_host_bytes_transformers_holds(model_dir):
    """transformers keeps a bitsandbytes plan's offloaded layers unquantized (knowledge/engines/
    transformers.yaml keeps_quantization: false): the host holds what a bf16 plan's would, while
    the GPU frees only the int8 layers' bytes."""
    q = plan(model_dir, "cpu", 2, "int8").predicted.memory.stages[0]
    dense = plan(model_dir, "cpu", 2).predicted.memory.stages[0]
    assert _within(q.host_offload_bytes, dense.host_offload_bytes)
    assert q.per_gpu_bytes["weights"] < 0.7 * dense.per_gpu_bytes["weights"]


@pytest.mark.consumers
@pytest.mark.parametrize("quantization", ["int8", "nf4"])
def test_quantization_config_is_what_transformers_writes(model_dir, tmp_path, quantization):
    import torch
    from transformers import BitsAndBytesConfig

    for offload in (False, True):
        m = plan(model_dir, "cpu" if offload else "none", 2 if offload else 0, quantization)
        cfg = json.loads(files(m, model_dir)["quantization_config.json"])
        if quantization == "int8":
            own = BitsAndBytesConfig(load_in_8bit=True, llm_int8_enable_fp32_cpu_offload=offload)
        else:
            own = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16,
                                     llm_int8_enable_fp32_cpu_offload=offload)
        assert cfg == own.to_dict()
        assert BitsAndBytesConfig.from_dict(cfg).to_dict() == BitsAndBytesConfig(**cfg).to_dict() == cfg


def _import_load_py(folder: Path):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"load_{abs(hash(folder))}", folder / "load.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ----- bad input -------------------------------------------------------------------------------


def test_load_py_refuses_an_offload_folder_it_cannot_write(model_dir, tmp_path):
    out = tmp_path / "export"
    out.mkdir()
    for f in export(plan(model_dir, "nvme", 2), "accelerate", spec=load_model(str(model_dir / "config.json")).spec):
        (out / f.name).write_text(f.text)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    r = subprocess.run([sys.executable, str(out / "load.py"), "--offload-folder", str(blocker / "offload")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("load.py: offload folder") and "not writable" in lines[0]
    assert "--offload-folder" in lines[0] and not r.stdout


def test_export_refuses_offload_layers_over_pipeline_stages(model_dir):
    m = plan(model_dir, "cpu", 2)
    bad = m.model_copy(update={"layout": m.layout.model_copy(update={"pp": 2})})
    with pytest.raises(CannotExpress) as e:
        files(bad, model_dir)
    assert e.value.field == "layout.offload_layers"

