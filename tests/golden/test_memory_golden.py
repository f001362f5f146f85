"""Golden tests: the memory model against published figures, each with its tolerance."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from conftest import validation_file
from shardplan.cost.estimate import estimate
from shardplan.cost.layout import Layout, Offload, PipelineSchedule, Recompute
from shardplan.cost.memory_serving import kv_bytes_per_token_per_layer_per_rank
from shardplan.cost.memory_training import deepspeed_estimator_host_bytes, model_states_bytes, state_bytes
from shardplan.cost.workload import Framework, InferenceWorkload, TrainingWorkload
from shardplan.specs.loading import load_hardware, load_model
from shardplan.specs.model import ModelSpec, NormType
from shardplan.units import BYTES_PER_GIB, BYTES_PER_MIB

GB = 1e9


def _zero():
    return yaml.safe_load(validation_file("zero.yaml").read_text())


def _gpu_bytes(P, LL, n, stage, framework, off_opt=Offload.NONE, off_par=Offload.NONE):
    sb = state_bytes(TrainingWorkload(framework=framework), stage)
    ms = model_states_bytes(P, LL, n, stage, sb, off_opt, off_par)
    return ms.weights + ms.gradients + ms.optimizer + ms.temporary


PAPER_P = {"7.5B": 7.5e9, "128B": 128e9, "1T": 1e12}


def _table1_cells():
    t = _zero()["zero_paper"]["table1_GB"]
    for model, rows in t.items():
        if model == "derived_check":
            continue
        for nd, cells in rows.items():
            for stage, gb in zip((1, 2, 3), cells):
                yield model, int(nd), stage, gb


@pytest.mark.parametrize("model,nd,stage,gb", list(_table1_cells()))
def test_zero_paper_table1(model, nd, stage, gb):
    got = _gpu_bytes(PAPER_P[model], 0, nd, stage, Framework.ZERO) / GB
    # 1%, or half a unit of the table's last printed digit (0.117 is printed 0.12).
    assert got == pytest.approx(gb, rel=0.01, abs=0.005)


def test_zero_paper_figure1():
    f = _zero()["zero_paper"]["figure1"]
    for stage, key in enumerate(("baseline", "os", "os_g", "os_g_p")):
        got = _gpu_bytes(float(f["params"]), 0, f["Nd"], stage, Framework.ZERO) / GB
        assert got == pytest.approx(f["GB_decimal"][key], rel=0.01, abs=0.05), key  # 1.875 is printed 1.9


def _ds_cases():
    for ex in _zero()["deepspeed_estimators"]["examples"]:
        if "per_gpu_GiB" in ex and not isinstance(ex["per_gpu_GiB"], list) and "largest_layer" in ex or (
            ex.get("stage") == 3 and "per_gpu_GiB" in ex and not isinstance(ex["per_gpu_GiB"], list)
        ):
            yield ex


# t5-3b's largest layer is its shared embedding, 32128 x 1024 (the printout rounds it to "32M").
T5_3B_LARGEST_LAYER = 32128 * 1024


@pytest.mark.parametrize("ex", list(_ds_cases()), ids=lambda e: f"{e['model']}-s{e['stage']}-{e.get('offload_optimizer')}-{e.get('offload_param')}")
def test_deepspeed_estimator_printouts(ex):
    P = float(ex["total_params"]) if "total_params" in ex else 2851e6
    LL = float(T5_3B_LARGEST_LAYER if ex["model"] == "t5-3b" else ex["largest_layer"])
    n = ex.get("gpus") or ex["nodes"] * ex["gpus_per_node"]
    off_opt = Offload.CPU if ex.get("offload_optimizer") == "cpu" else Offload.NONE
    off_par = Offload.CPU if ex.get("offload_param") == "cpu" else Offload.NONE
    got = _gpu_bytes(P, LL, n, ex["stage"], Framework.DEEPSPEED, off_opt, off_par) / BYTES_PER_GIB
    # 2%, or half a unit of the printout's last digit (0.1226 GiB prints as 0.12).
    assert got == pytest.approx(ex["per_gpu_GiB"], rel=0.02, abs=0.005)
    if "per_cpu_GiB" in ex:
        host = deepspeed_estimator_host_bytes(
            P, LL, ex["stage"], off_opt is not Offload.NONE, off_par is not Offload.NONE,
            ex.get("gpus_per_node", n), ex.get("nodes", 1),
        )
        assert host / BYTES_PER_GIB == pytest.approx(ex["per_cpu_GiB"], rel=0.02)


def test_deepspeed_t5_large_mib_cases():
    ex = next(e for e in _zero()["deepspeed_estimators"]["examples"] if e["model"] == "t5-large")
    P, LL, n = float(ex["total_params"]), float(ex["largest_layer"]), ex["gpus"]
    mib = ex["MiB"]
    cases = {
        "case1_no_offload": (Offload.NONE, Offload.NONE),
        "case2_full_offload": (Offload.CPU, Offload.CPU),
        "case3_opt_offload": (Offload.CPU, Offload.NONE),
    }
    for key, (oo, op) in cases.items():
        got = _gpu_bytes(P, LL, n, 3, Framework.DEEPSPEED, oo, op) / BYTES_PER_MIB
        assert got == pytest.approx(mib[key], rel=0.02), key


# ----- Korthikanti et al. 2022 activations -------------------------------------------------


def _gpt(h, a, L, vocab=51200):
    return ModelSpec(
        name=f"gpt-{h}", vocab_size=vocab, hidden_size=h, num_layers=L, num_attention_heads=a,
        intermediate_size=4 * h, mlp_gated=False, hidden_act="gelu", norm_type=NormType.LAYERNORM,
        qkv_bias=True, o_bias=True, mlp_bias=True, max_position_embeddings=2048,
    )


MODES = {
    "tp": (False, Recompute.NONE),
    "tp_sp": (True, Recompute.NONE),
    "tp_selective": (False, Recompute.SELECTIVE),
    "tp_sp_selective": (True, Recompute.SELECTIVE),
    "full": (False, Recompute.FULL),
}


def _korthikanti_cases():
    k = yaml.safe_load(validation_file("activations.yaml").read_text())["korthikanti2022"]
    for cfg in k["table3_configs"]:
        for mode, gib in k["derived_first_stage_GiB"][cfg["model"]].items():
            yield cfg, mode, gib


@pytest.mark.parametrize("cfg,mode,gib", list(_korthikanti_cases()), ids=lambda x: x["model"] if isinstance(x, dict) else str(x))
def test_korthikanti_first_stage_activations(cfg, mode, gib):
    sp, recompute = MODES[mode]
    spec = _gpt(cfg["hidden"], cfg["heads"], cfg["layers"])
    v = cfg.get("interleave_m", 1)
    layout = Layout(
        tp=cfg["tp"], pp=cfg["pp"], dp=cfg["gpus"] // (cfg["tp"] * cfg["pp"]), sequence_parallel=sp,
        recompute=recompute, micro_batch_size=cfg["micro_batch"], virtual_stages=v,
        pp_schedule=PipelineSchedule.INTERLEAVED if v > 1 else PipelineSchedule.ONE_F_ONE_B,
    )
    hw = load_hardware("a100-sxm-80gb").with_topology(gpus_per_node=8, num_nodes=cfg["gpus"] // 8)
    wl = TrainingWorkload(seq_len=2048, global_batch_size=cfg["global_batch"], flash_attention=False, dropout=True)
    rep = estimate(spec, hw, layout, wl).model_dump(mode="json")
    stage0 = rep["memory"]["per_rank"][0]
    assert stage0["detail_bytes"]["activations.layers"] / BYTES_PER_GIB == pytest.approx(gib, rel=0.02)


def test_korthikanti_output_layer_term_with_sequence_parallelism():
    # Paper: [p == 1] 4 s b h / t (1 + v / h) for the last layer norm, lm_head input and fp32 logits.
    spec = _gpt(6144, 64, 48)
    layout = Layout(tp=8, sequence_parallel=True, micro_batch_size=4)
    hw = load_hardware("a100-sxm-80gb")
    wl = TrainingWorkload(seq_len=2048, global_batch_size=4, flash_attention=False, dropout=True)
    rank = estimate(spec, hw, layout, wl).model_dump(mode="json")["memory"]["per_rank"][0]
    s, b, h, t, v = 2048, 4, 6144, 8, 51200
    d = rank["detail_bytes"]
    assert d["activations.head"] + d["activations.loss"] == pytest.approx(4 * s * b * h / t * (1 + v / h), rel=1e-9)


def test_full_recompute_holds_one_layers_whole_activations_beside_the_checkpoints():
    """Full checkpointing keeps each layer's input (2 s b h per layer) and, in backward, one layer
    re-run whole: Korthikanti et al. 2022, eq. 2, s b h (10 + 24 / t + 5 a s / (h t)) for tensor
    parallelism without sequence parallelism. Stage 0 of two (not the loss's stage), 1F1B, so it
    holds min(pp, m) = 2 micro-batches of its 24 layers' checkpoints."""
    spec = _gpt(6144, 64, 48)
    s, b, h, a, t = 2048, 4, 6144, 64, 8
    layout = Layout(tp=t, pp=2, dp=1, micro_batch_size=b, recompute=Recompute.FULL)
    hw = load_hardware("a100-sxm-80gb").with_topology(gpus_per_node=8, num_nodes=2)
    wl = TrainingWorkload(seq_len=s, global_batch_size=4 * b, flash_attention=False, dropout=True)
    ranks = estimate(spec, hw, layout, wl).model_dump(mode="json")["memory"]["per_rank"]
    d = ranks[0]["detail_bytes"]
    assert d["activations.layers"] == pytest.approx(2 * s * b * h * 24 * 2, rel=1e-9)
    assert d["activations.recomputed_layer"] == pytest.approx(s * b * h * (10 + 24 / t + 5 * a * s / (h * t)), rel=1e-9)
    acts = sum(v for k, v in d.items() if k.startswith("activations."))
    assert acts == pytest.approx(ranks[0]["per_gpu_bytes"]["activations"], rel=1e-12)
    # The last stage: the loss head's tensors are freed by their backward before the last layer
    # is re-run, so the stage holds the larger of the two, not both.
    last = ranks[-1]["detail_bytes"]
    head = last["activations.head"] + last["activations.loss"]
    assert ranks[-1]["per_gpu_bytes"]["activations"] == pytest.approx(
        last["activations.layers"] + max(head, d["activations.recomputed_layer"]), rel=1e-9)


# ----- vLLM start-up memory ----------------------------------------------------------------


def _serving_cases():
    return {c["id"]: c for c in yaml.safe_load(validation_file("serving_memory.yaml").read_text())["cases"]}


def test_vllm_llama3_8b_weights_and_kv_capacity():
    case = _serving_cases()["vllm-pr10511-tp1"]
    # Meta-Llama-3-8B: the Llama-3.1-8B architecture with an 8192-token context.
    spec = load_model("llama-3.1-8b").spec.model_copy(update={"max_position_embeddings": 8192, "name": "llama-3-8b"})
    total_gib = float(case["gpu"].split("total_gpu_memory ")[1].split(" GiB")[0])
    hw = dataclasses.replace(
        load_hardware("h100-sxm-80gb").with_topology(gpus_per_node=1), memory_capacity_bytes=int(total_gib * BYTES_PER_GIB)
    )
    wl = InferenceWorkload(gpu_memory_utilization=case["gpu_memory_utilization"], max_num_batched_tokens=8192)
    rep = estimate(spec, hw, Layout(tp=case["tensor_parallel_size"]), wl).model_dump(mode="json")
    mem = rep["memory"]["per_gpu_bytes"]
    reported = case["reported_GiB"]
    assert rep["memory"]["budget_bytes"] / BYTES_PER_GIB == pytest.approx(reported["budget"], rel=0.001)
    assert mem["weights"] / BYTES_PER_GIB == pytest.approx(reported["weights"], rel=0.01)
    assert rep["kv_cache"]["capacity_tokens"] == pytest.approx(case["derived"]["kv_tokens"], rel=0.05)
    assert rep["kv_cache"]["num_blocks"] == pytest.approx(case["derived"]["blocks16"], rel=0.05)


def test_vllm_llama_3_2_vision_kv_blocks_from_reported_kv_bytes():
    case = _serving_cases()["vllm-pr12126"]
    # The text decoder of Llama-3.2-11B-Vision: 40 layers (32 self- and 8 cross-attention), 8 KV heads of 128.
    text = ModelSpec(
        name="llama-3.2-11b-vision-text", vocab_size=128256, hidden_size=4096, num_layers=40, num_attention_heads=32,
        num_kv_heads=8, intermediate_size=14336, max_position_embeddings=131072,
    )
    per_token = kv_bytes_per_token_per_layer_per_rank(text, 1, 2.0) * text.num_layers
    blocks = case["reported_GiB"]["kv_cache"] * BYTES_PER_GIB // (case["block_size"] * per_token)
    assert per_token == 160 * 1024
    assert blocks == pytest.approx(case["reported_gpu_blocks"], abs=2)
