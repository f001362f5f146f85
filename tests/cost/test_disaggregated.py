"""Disaggregated prefill/decode (cost/disaggregated.py) and recommend's comparison with aggregated."""

from __future__ import annotations

import pytest

from shardplan.cost import inputs
from shardplan.cost.disaggregated import kv_transfer_seconds
from shardplan.cost.kv import kv_cache_bytes_per_token
from shardplan.knowledge.load import engine_rules
from shardplan.specs import loading

SPEC = loading.load_model("llama-3.1-8b").spec
H100 = loading.load_hardware("h100-sxm-80gb")


def _wl():
    return inputs.inference_workload(engine=engine_rules("vllm", None), hw=H100,
                                     model_max_len=SPEC.max_position_embeddings, max_model_len=8192, max_num_seqs=None,
                                     max_num_batched_tokens=None, gpu_memory_utilization=None, block_size=None,
                                     kv_cache_dtype=None, weight_dtype=None, quantization=None, enforce_eager=False,
                                     input_len=4000, output_len=500, batch_size=None)


@pytest.mark.parametrize("tp, across", [(1, False), (4, False), (2, True)])
def test_kv_transfer_is_the_prompts_cache_over_the_link_split_by_the_senders(tp, across):
    nbytes, seconds, link = kv_transfer_seconds(SPEC, H100, _wl(), 4000, tp, across)
    # Llama 3.1 8B: 32 layers x 8 KV heads x 128 x (K, V) x 2 bytes = 131,072 bytes a token.
    assert kv_cache_bytes_per_token(SPEC, 2) == 131_072
    assert nbytes == 4000 * 131_072
    lk = H100.inter_node if across else H100.intra_node
    assert seconds == pytest.approx(lk.latency_seconds + nbytes / tp / (lk.bandwidth_bytes_per_second * lk.efficiency))
    assert link == lk.kind.value


def _rec(cli, *args):
    res = cli("recommend", "llama-3.1-8b", "--gpus", "8", *args, "--json")
    assert res.exit_code == 0, res.stderr
    return res.json()


def test_recommend_compares_the_pools_and_their_figures_add_up(cli):
    d = _rec(cli, "--input-len", "4000", "--output-len", "1000")
    x = d["disaggregated"]
    assert x["prefill_replicas"] * x["prefill_tp"] + x["decode_replicas"] * x["decode_tp"] <= 8
    assert x["output_tokens_per_second_per_gpu"] == pytest.approx(x["request_rate_per_second"] * 1000 / 8, rel=1e-9)
    # The pick on the split's terms: the rate it was judged at (the most within the SLA) times its outputs. Its own
    # goodput, the simulated run's output, is lower by the run's ramp and drain, which the split's figure does not have.
    load = d["top"][0]["load"]
    assert x["offered_request_rate_per_second"] is None
    assert x["aggregated_request_rate_per_second"] == pytest.approx(load["request_rate"], rel=1e-9)
    assert x["aggregated_output_tokens_per_second_per_gpu"] == pytest.approx(load["request_rate"] * 1000 / 8, rel=1e-9)
    assert 0.8 < load["output_tokens_per_second_per_gpu"] / x["aggregated_output_tokens_per_second_per_gpu"] < 1.0
    assert x["winner"] == ("disaggregated" if x["output_tokens_per_second_per_gpu"]
                           > x["aggregated_output_tokens_per_second_per_gpu"] else "aggregated")
    assert x["why"].startswith(x["winner"] + " wins by")


def test_at_a_given_rate_the_split_is_compared_with_the_most_the_ranked_plans_carry(cli):
    """Every ranked plan meets the SLA at the offered rate (they are ranked by latency there), so
    the comparison is by headroom: the most each arrangement carries within the SLA. The aggregated
    side is the best ranked plan at its most, which no ranked plan's own offered rate exceeds."""
    d = _rec(cli, "--input-len", "8000", "--output-len", "300", "--max-tpot-ms", "20", "--max-ttft-ms", "2000",
             "--request-rate", "5")
    x = d["disaggregated"]
    assert x["offered_request_rate_per_second"] == 5
    assert all(e["load"]["request_rate"] == 5 for e in d["top"])
    assert x["aggregated_request_rate_per_second"] > 5
    assert x["aggregated_output_tokens_per_second_per_gpu"] == pytest.approx(
        x["aggregated_request_rate_per_second"] * 300 / 8, rel=1e-9)
    # Long prompts and a tight TPOT favour the pools at a given rate as without one.
    assert x["winner"] == "disaggregated"
    assert x["why"].startswith("disaggregated has") and "the offered 5.00 req/s" in x["why"]


def test_a_client_concurrency_is_not_compared_and_the_split_cannot_be_written(cli, tmp_path):
    d = _rec(cli, "--concurrency", "64")
    assert d.get("disaggregated") is None
    res = cli("recommend", "llama-3.1-8b", "--gpus", "8", "--concurrency", "64", "--disaggregated",
              "-o", str(tmp_path / "plan.yaml"))
    assert res.exit_code == 2 and len(res.stderr.strip().splitlines()) == 1
    assert "--concurrency" in res.stderr and not (tmp_path / "plan.yaml").exists()


def test_a_tight_tpot_with_long_prompts_favours_separate_pools(cli):
    """vLLM's mixed steps put 8K-token prompt chunks beside the decodes: a 20 ms TPOT caps the
    aggregated rate, while a decode pool's steps carry no prompts (DistServe's argument). With short
    prompts there is little prefill to keep out of the decode steps, and one pool of 8 GPUs wins."""
    tight = _rec(cli, "--input-len", "8000", "--output-len", "300", "--max-tpot-ms", "20", "--max-ttft-ms", "2000")
    loose = _rec(cli, "--input-len", "200", "--output-len", "500")
    assert tight["disaggregated"]["winner"] == "disaggregated"
    assert loose["disaggregated"]["winner"] == "aggregated"


def test_the_split_goes_into_the_manifest_and_vllm_launches_its_pools(cli, tmp_path):
    import json
    import re

    from shardplan.plan.manifest import load_manifest

    plan = tmp_path / "plan.yaml"
    res = cli("recommend", "llama-3.1-8b", "--gpus", "8", "--input-len", "8000", "--output-len", "300",
              "--max-tpot-ms", "20", "--max-ttft-ms", "2000", "--disaggregated", "-o", str(plan), "--json")
    assert res.exit_code == 0, res.stderr
    d = load_manifest(plan).disaggregation
    assert d is not None and d.winner == res.json()["disaggregated"]["winner"]
    out = tmp_path / "out"
    res = cli("export", str(plan), "--to", "vllm", "--disaggregated", "-o", str(out))
    assert res.exit_code == 0, res.stderr
    text = (out / "serve_disagg.sh").read_text()
    _sglang_pools(cli, plan, tmp_path / "sg", d)
    devices = re.findall(r"CUDA_VISIBLE_DEVICES=([0-9,]+) vllm serve", text)
    gpus = [int(g) for ds in devices for g in ds.split(",")]
    assert len(devices) == d.prefill.replicas + d.decode.replicas
    assert sorted(gpus) == list(range(d.prefill.tp * d.prefill.replicas + d.decode.tp * d.decode.replicas))
    ports = re.findall(r"--port (\d+)", text)
    assert len(set(ports)) == len(ports) == len(devices)
    configs = [json.loads(c) for c in re.findall(r"--kv-transfer-config '([^']+)'", text)]
    assert len(configs) == len(devices) and all(c == {"kv_connector": "NixlConnector", "kv_role": "kv_both"} for c in configs)


def test_a_plan_without_a_split_or_without_a_manifest_is_one_line(cli, tmp_path):
    plan = tmp_path / "plan.yaml"
    assert cli("recommend", "llama-3.1-8b", "--gpus", "2", "-o", str(plan), "--json").exit_code == 0
    res = cli("export", str(plan), "--to", "vllm", "--disaggregated")
    assert res.exit_code == 2 and len(res.stderr.strip().splitlines()) == 1 and "disaggregat" in res.stderr
    res = cli("recommend", "llama-3.1-8b", "--gpus", "2", "--disaggregated")
    assert res.exit_code == 2 and "-o" in res.stderr


def _sglang_pools(cli, plan, out, d):
    import re

    res = cli("export", str(plan), "--to", "sglang", "--disaggregated", "-o", str(out))
    assert res.exit_code == 0, res.stderr
    text = (out / "serve_disagg.sh").read_text()
    modes = re.findall(r"--disaggregation-mode (prefill|decode)", text)
    assert modes.count("prefill") == d.prefill.replicas and modes.count("decode") == d.decode.replicas
    assert len(re.findall(r"--disaggregation-bootstrap-port (\d+)", text)) == d.prefill.replicas
    assert "--pd-disaggregation" in text


@pytest.mark.parametrize("engine, needle", [("vllm", "NixlConnector"), ("sglang", "--disaggregation-mode")])
def test_kubernetes_runs_each_pool_as_its_own_deployment(cli, tmp_path, engine, needle):
    import yaml

    from shardplan.plan.manifest import load_manifest

    plan = tmp_path / "plan.yaml"
    assert cli("recommend", "llama-3.1-8b", "--gpus", "8", "--input-len", "8000", "--output-len", "300",
               "--max-tpot-ms", "20", "--max-ttft-ms", "2000", "--disaggregated", "-o", str(plan)).exit_code == 0
    d = load_manifest(plan).disaggregation
    res = cli("export", str(plan), "--to", "kubernetes", "--engine", engine, "--disaggregated", "-o", str(tmp_path / "k"))
    assert res.exit_code == 0, res.stderr
    objs = list(yaml.safe_load_all((tmp_path / "k" / "deployment.yaml").read_text()))
    deps = {o["metadata"]["name"].rsplit("-", 1)[1]: o for o in objs if o["kind"] == "Deployment"}
    assert set(deps) == {"prefill", "decode"}
    for role, pool in (("prefill", d.prefill), ("decode", d.decode)):
        spec = deps[role]["spec"]
        assert spec["replicas"] == pool.replicas
        container = spec["template"]["spec"]["containers"][0]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == pool.tp
        assert needle in container["args"][0]
    assert sum(1 for o in objs if o["kind"] == "Service") == 2
