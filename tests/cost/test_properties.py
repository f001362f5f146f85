"""Property tests (hypothesis) over the loaders and the memory model.

Loaders: any bytes, any config dict, any edit of a hardware profile or a manifest either loads
into a valid object or raises shardplan's own error (never a TypeError, RecursionError, ...).
Memory: any valid spec and layout gives finite, non-negative bytes whose parts sum to their
total on every rank; memory grows with context, micro-batch and dtype size, and never grows when
a degree that shards a component (tp for weights and KV heads, dp for ZeRO-sharded states) grows.
(Time figures have their own properties in test_time_properties.py.)
"""

from __future__ import annotations

import copy
import math
import tempfile
from pathlib import Path

import yaml
from conftest import REPO, build_plan
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from shardplan.cost.estimate import estimate
from shardplan.cost.layout import Layout, Recompute
from shardplan.cost.workload import InferenceWorkload, TrainingWorkload
from shardplan.errors import LayoutError, ShardplanError
from shardplan.plan.manifest import load_manifest
from shardplan.plan.schema import DeploymentManifest
from shardplan.specs.cluster import cluster
from shardplan.specs.hardware import HardwareProfile
from shardplan.specs.loading import hardware_from_data, load_hardware, model_from_data, read_structured
from shardplan.specs.model import MAX_LAYERS, MAX_WIDTH, ModelSpec, MoESpec
from shardplan.units import DType

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
H100 = load_hardware("h100-sxm-80gb")

# ----- loaders -----------------------------------------------------------------------------

# Values a hostile or broken file may hold where a number belongs.
ODD = st.one_of(
    st.integers(-(2**70), 2**70), st.sampled_from([0, -1, 1, 2**31, 10**400]),
    st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.none(),
    st.text(max_size=8), st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
HF_KEYS = ["model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
           "intermediate_size", "vocab_size", "max_position_embeddings", "rope_theta", "sliding_window",
           "use_sliding_window", "tie_word_embeddings", "num_local_experts", "num_experts", "num_experts_per_tok",
           "moe_intermediate_size", "mlp_only_layers", "decoder_sparse_step", "n_routed_experts", "kv_lora_rank",
           "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "first_k_dense_replace",
           "text_config", "architectures", "torch_dtype", "hidden_act", "rotary_pct", "n_embd", "n_layer", "n_head"]
GOOD_HF = {"hidden_size": 512, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4,
           "intermediate_size": 1024, "vocab_size": 1000, "max_position_embeddings": 256, "num_local_experts": 4,
           "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 256, "kv_lora_rank": 64,
           "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32, "n_embd": 512, "n_layer": 2, "n_head": 8}
MODEL_TYPES = ["llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2", "gpt2",
               "gpt_neox", "falcon", "phi3", "deepseek_v2", "deepseek_v3", "mamba"]


def _valid_spec(spec: ModelSpec) -> None:
    assert isinstance(spec, ModelSpec)
    assert 0 < spec.num_layers <= MAX_LAYERS and 0 < spec.hidden_size <= MAX_WIDTH
    assert spec.num_attention_heads % spec.kv_heads == 0


@SETTINGS
@given(model_type=st.sampled_from(MODEL_TYPES), broken=st.dictionaries(st.sampled_from(HF_KEYS), ODD, max_size=4),
       dropped=st.sets(st.sampled_from(sorted(GOOD_HF)), max_size=3))
def test_any_hf_config_loads_or_raises_our_error(model_type, broken, dropped):
    cfg = {k: v for k, v in {"model_type": model_type, **GOOD_HF}.items() if k not in dropped} | broken
    try:
        loaded = model_from_data(cfg, "config.json", "m")
    except ShardplanError as e:
        assert e.source == "config.json" and e.one_line().count("\n") == 0
        return
    _valid_spec(loaded.spec)


@SETTINGS
@given(arch=st.dictionaries(st.sampled_from(sorted(ModelSpec.model_fields) + ["moe", "hiden_size"]), ODD, max_size=10))
def test_any_architecture_block_loads_or_raises_our_error(arch):
    try:
        loaded = model_from_data({"name": "m", "architecture": arch}, "m.yaml", "m")
    except ShardplanError as e:
        assert e.source == "m.yaml"
        return
    _valid_spec(loaded.spec)


@SETTINGS
@given(data=st.one_of(st.binary(max_size=200), st.text(max_size=200).map(str.encode)),
       suffix=st.sampled_from([".json", ".yaml"]))
def test_any_bytes_parse_or_raise_our_error(data, suffix):
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / f"f{suffix}"
        p.write_bytes(data)
        try:
            read_structured(p)
        except ShardplanError as e:
            assert e.source == str(p)


def _leaves(d, prefix=()):
    if isinstance(d, dict):
        for k, v in d.items():
            yield from _leaves(v, (*prefix, k))
    elif isinstance(d, list):
        for i, v in enumerate(d):
            yield from _leaves(v, (*prefix, i))
    else:
        yield prefix


def _set(d, path, value):
    out = copy.deepcopy(d)
    node = out
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value
    return out


HW_DATA = yaml.safe_load((REPO / "hardware_profiles" / "h100-sxm-80gb.yaml").read_text())
HW_LEAVES = list(_leaves(HW_DATA))


@SETTINGS
@given(path=st.sampled_from(HW_LEAVES), value=ODD)
def test_any_hardware_edit_loads_or_raises_our_error(path, value):
    try:
        hw = hardware_from_data(_set(HW_DATA, path, value), "hw.yaml")
    except ShardplanError as e:
        assert e.source == "hw.yaml" and e.field  # names the field
        return
    assert isinstance(hw, HardwareProfile)
    assert all(math.isfinite(v) and v > 0 for v in hw.peak_flops.values())
    assert 0 < hw.memory_capacity_bytes < 2**63 and math.isfinite(hw.memory_bandwidth_bytes_per_second)


MANIFEST = build_plan("llama-3.1-8b", 8, Layout(tp=2, dp=4), InferenceWorkload(max_model_len=8192))[0].model_dump(mode="json")
MANIFEST_LEAVES = list(_leaves(MANIFEST))


@settings(max_examples=30, deadline=None)
@given(path=st.sampled_from(MANIFEST_LEAVES), value=ODD)
def test_any_manifest_edit_loads_or_raises_our_error(path, value):
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "plan.yaml"
        p.write_text(yaml.safe_dump(_set(MANIFEST, path, value), sort_keys=False))
        try:
            m = load_manifest(p)
        except ShardplanError as e:
            assert e.source == str(p)
            return
    assert isinstance(m, DeploymentManifest)
    assert m.layout.tp * m.layout.pp * m.layout.cp * m.layout.dp == m.hardware.num_gpus


# ----- the memory model --------------------------------------------------------------------


@st.composite
def specs(draw) -> ModelSpec:
    heads = draw(st.sampled_from([4, 8, 16, 32]))
    kv = draw(st.sampled_from([d for d in (1, 2, 4, 8, 16, 32) if heads % d == 0]))
    head_dim = draw(st.sampled_from([32, 64, 128]))
    moe = None
    if draw(st.booleans()):
        n = draw(st.sampled_from([4, 8, 16]))
        moe = MoESpec(num_experts=n, num_experts_per_token=draw(st.integers(1, min(n, 4))),
                      expert_intermediate_size=draw(st.sampled_from([256, 512, 1024])))
    return ModelSpec(
        name="p", hidden_size=heads * head_dim, num_attention_heads=heads, num_kv_heads=kv,
        num_layers=draw(st.integers(2, 48)), intermediate_size=draw(st.sampled_from([1024, 2048, 4096, 8192])),
        vocab_size=draw(st.sampled_from([1024, 32000, 128256])), max_position_embeddings=32768,
        tie_word_embeddings=draw(st.booleans()), moe=moe,
    )


def _check_memory(report: dict) -> None:
    mem = report["memory"]
    for part in [mem, *mem["per_rank"]]:
        b = part["per_gpu_bytes"]
        body = {k: v for k, v in b.items() if k != "total"}
        assert all(math.isfinite(v) and v >= 0 for v in body.values()), body
        assert math.isclose(sum(body.values()), b["total"], rel_tol=1e-9), b
    for r in mem["per_rank"]:
        assert r["host_offload_bytes"] >= 0 and r["nvme_offload_bytes"] >= 0
    assert max(r["per_gpu_bytes"]["total"] for r in mem["per_rank"]) == mem["per_gpu_bytes"]["total"]


def _hw(num_gpus: int):
    return cluster(H100, gpus=num_gpus, nodes=None, gpus_per_node=None)


def _train(spec, *, tp=1, pp=1, dp=1, zero=0, mb=1, seq=1024, rc=Recompute.NONE, dtype=DType.BF16):
    layout = Layout(tp=tp, pp=pp, dp=dp, zero_stage=zero, micro_batch_size=mb, recompute=rc)
    wl = TrainingWorkload(seq_len=seq, global_batch_size=8 * dp * mb, param_dtype=dtype)
    return estimate(spec, _hw(tp * pp * dp), layout, wl).model_dump(mode="json")


def _peak(report: dict, part: str = "total") -> float:
    return max(r["per_gpu_bytes"][part] for r in report["memory"]["per_rank"])


@SETTINGS
@given(spec=specs(), tp=st.sampled_from([1, 2, 4]), pp=st.sampled_from([1, 2]), dp=st.sampled_from([1, 2]),
       zero=st.integers(0, 3), mb=st.sampled_from([1, 2]), seq=st.sampled_from([256, 1024, 4096]),
       rc=st.sampled_from(list(Recompute)))
def test_training_memory_is_finite_and_grows_with_context_batch_and_dtype(spec, tp, pp, dp, zero, mb, seq, rc):
    try:
        base = _train(spec, tp=tp, pp=pp, dp=dp, zero=zero, mb=mb, seq=seq, rc=rc)
    except LayoutError:
        assume(False)
    _check_memory(base)
    longer = _train(spec, tp=tp, pp=pp, dp=dp, zero=zero, mb=mb, seq=seq * 2, rc=rc)
    bigger = _train(spec, tp=tp, pp=pp, dp=dp, zero=zero, mb=mb * 2, seq=seq, rc=rc)
    wider = _train(spec, tp=tp, pp=pp, dp=dp, zero=zero, mb=mb, seq=seq, rc=rc, dtype=DType.FP32)
    for other in (longer, bigger, wider):
        _check_memory(other)
        for r0, r1 in zip(base["memory"]["per_rank"], other["memory"]["per_rank"]):
            assert r1["per_gpu_bytes"]["total"] >= r0["per_gpu_bytes"]["total"] * (1 - 1e-12)
    assert _peak(longer, "activations") > _peak(base, "activations")
    assert _peak(wider, "weights") > _peak(base, "weights")


@SETTINGS
@given(spec=specs(), tp=st.sampled_from([1, 2, 4]), zero=st.integers(0, 3), mb=st.sampled_from([1, 2]))
def test_a_degree_that_shards_a_component_never_grows_it(spec, tp, zero, mb):
    try:
        one = _train(spec, tp=tp, dp=2, zero=zero, mb=mb)
        more_dp = _train(spec, tp=tp, dp=4, zero=zero, mb=mb)
        more_tp = _train(spec, tp=tp * 2, dp=2, zero=zero, mb=mb)
    except LayoutError:
        assume(False)
    for part in ("weights", "gradients", "optimizer_states"):  # dp shards these by ZeRO stage, or leaves them
        assert _peak(more_dp, part) <= _peak(one, part)
    if zero >= 1:
        assert _peak(more_dp, "optimizer_states") < _peak(one, "optimizer_states")
    for part in ("weights", "gradients", "optimizer_states", "activations"):
        assert _peak(more_tp, part) <= _peak(one, part) * (1 + 1e-12)
    assert _peak(more_tp, "weights") < _peak(one, "weights")


@SETTINGS
@given(spec=specs(), tp=st.sampled_from([1, 2, 4]), max_len=st.sampled_from([512, 4096, 16384]))
def test_serving_memory_is_finite_and_kv_per_gpu_never_grows_with_tp(spec, tp, max_len):
    wl = InferenceWorkload(max_model_len=max_len, max_num_batched_tokens=4096)
    try:
        one = estimate(spec, _hw(tp), Layout(tp=tp), wl).model_dump(mode="json")
        two = estimate(spec, _hw(tp * 2), Layout(tp=tp * 2), wl).model_dump(mode="json")
    except LayoutError:
        assume(False)
    for rep in (one, two):
        _check_memory(rep)
        kv = rep["kv_cache"]
        assert all(math.isfinite(v) and v >= 0 for v in kv.values() if isinstance(v, (int, float)))
        assert kv["bytes_per_sequence"] == kv["bytes_per_token_per_gpu"] * kv["max_model_len"]
    assert two["kv_cache"]["bytes_per_token_per_gpu"] <= one["kv_cache"]["bytes_per_token_per_gpu"]
    assert two["memory"]["per_gpu_bytes"]["weights"] < one["memory"]["per_gpu_bytes"]["weights"]
    # a longer context never needs less KV cache per sequence
    longer = estimate(spec, _hw(tp), Layout(tp=tp), InferenceWorkload(max_model_len=max_len * 2, max_num_batched_tokens=4096)).model_dump(mode="json")
    assert longer["kv_cache"]["bytes_per_sequence"] >= one["kv_cache"]["bytes_per_sequence"]
