"""--recompute-modules (Megatron-Core's fine-grained selective recomputation): refused one line
at a time where the stack or the model has no such module, recorded in the estimate and the plan,
read back by replan, and what it frees shown in the activations."""

from __future__ import annotations

import pytest
import yaml

from shardplan.errors import EXIT_BAD_INPUT, EXIT_DOES_NOT_FIT, EXIT_OK

TRAIN = ["--workload", "training", "--gpus", "8", "--seq-len", "4096", "--global-batch-size", "64"]


@pytest.mark.parametrize(("model", "extra", "says"), [
    ("llama-3.1-8b", ["--stack", "torchtitan", "--recompute-modules", "moe_act"], "use --stack megatron"),
    ("llama-3.1-8b", ["--stack", "megatron", "--recompute-modules", "attn"], "'attn' is not one of"),
    ("llama-3.1-8b", ["--stack", "megatron", "--recompute-modules", "mla_up_proj"], "needs multi-head latent attention"),
    ("llama-3.1-8b", ["--stack", "megatron", "--recompute-modules", "moe_act"], "needs MoE layers"),
    ("mixtral-8x7b", ["--stack", "megatron", "--recompute-modules", "shared_experts"], "needs shared experts"),
    ("llama-3.1-8b", ["--stack", "megatron", "--recompute-modules", ","], "names no module"),
])
def test_a_module_the_stack_or_model_lacks_is_one_line_exit_2(cli, model, extra, says):
    res = cli("estimate", model, *TRAIN, *extra)
    assert res.exit_code == EXIT_BAD_INPUT
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "--recompute-modules" in lines[0] and says in lines[0]
    assert "Traceback" not in res.stderr


def _estimate(cli, *extra: str) -> dict:
    res = cli("estimate", "deepseek-v3", "-H", "h800-sxm-80gb", "--gpus", "2048", "--workload", "training",
              "--seq-len", "4096", "--global-batch-size", "15360", "--stack", "megatron", "--tp", "1", "--pp", "16",
              "--dp", "128", "--ep", "64", "--zero-stage", "1", "--micro-batch-size", "1", "--recompute", "selective",
              "--json", *extra)
    assert res.exit_code in (EXIT_OK, EXIT_DOES_NOT_FIT), res.stderr
    return res.json()


def _peak_activations(d: dict) -> float:
    return max(r["per_gpu_bytes"]["activations"] for r in d["memory"]["per_rank"])


def test_estimate_records_the_modules_and_each_frees_activations(cli):
    default = _estimate(cli)
    assert default["workload"]["recompute_modules"] == ["core_attn"]  # Megatron's default
    deepseek = _estimate(cli, "--recompute-modules", "layernorm,mla_up_proj,moe_act")
    assert deepseek["workload"]["recompute_modules"] == ["layernorm", "mla_up_proj", "moe_act"]
    # DeepSeek-V3's recipe (norms, MLA up-projections, the SwiGLU output) frees more than a third of
    # the first stages' activations; recomputing them beside the attention core lengthens the step
    assert _peak_activations(deepseek) < 0.65 * _peak_activations(default)
    more = _estimate(cli, "--recompute-modules", "core_attn,layernorm,mla_up_proj,moe_act")
    assert more["time"]["step_seconds"] > default["time"]["step_seconds"]


def test_replan_reads_the_modules_back_from_the_plan(cli, tmp_path):
    plan = tmp_path / "plan.yaml"
    res = cli("recommend", "mixtral-8x7b", "--gpus", "16", "--workload", "training", "--stack", "megatron",
              "--seq-len", "4096", "--global-batch-size", "256", "--recompute", "selective", "--tp", "2", "--ep", "8",
              "--zero-stage", "1", "--recompute-modules", "moe_act,layernorm", "-o", str(plan))
    assert res.exit_code == EXIT_OK, res.stderr
    assert yaml.safe_load(plan.read_text())["workload"]["recompute_modules"] == ["moe_act", "layernorm"]
    from shardplan.plan.readback import read_plan

    assert read_plan(plan).workload.recompute_modules == ("moe_act", "layernorm")
