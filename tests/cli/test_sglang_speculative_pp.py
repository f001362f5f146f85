"""SGLang's server_args asserts that pipeline parallelism runs no speculative algorithm ("PP and
speculative decoding are currently mutually exclusive (server_args.py asserts)", sgl-project/sglang#30775,
which runs them together only behind SGLANG_ENABLE_PP_SPEC=1, "default behavior is unchanged"). A plan
for SGLang with both does not start; with pp 1, or without the drafter, it does."""

from __future__ import annotations


def _estimate(cli, *args: str) -> dict:
    res = cli("estimate", "deepseek-v3", "-H", "h200-sxm-141gb", "--engine", "sglang", "--max-model-len", "8192",
              "--json", *args)
    assert res.exit_code in (0, 3), res.stderr  # 3: does not fit, the report still printed
    return res.json()


def test_sglang_refuses_mtp_with_pipeline_stages(cli):
    d = _estimate(cli, "--gpus", "16", "--tp", "8", "--pp", "2", "--speculative-method", "mtp")
    assert not d["fits"] and "does not run speculative decoding with pipeline parallelism (pp 2)" in d["reason"]
    assert d["workload"]["speculative_with_pp"] is False
    assert _estimate(cli, "--gpus", "16", "--tp", "8", "--pp", "2")["fits"]  # no drafter
    assert _estimate(cli, "--gpus", "16", "--tp", "16", "--speculative-method", "mtp")["fits"]  # one stage


def test_recommend_for_sglang_with_mtp_keeps_one_stage(cli):
    res = cli("recommend", "deepseek-v3", "-H", "h200-sxm-141gb", "--gpus", "16", "--engine", "sglang",
              "--max-model-len", "8192", "--speculative-method", "mtp", "--top", "10", "--json")
    assert res.exit_code == 0, res.stderr
    top = res.json()["top"]
    assert top and {e["plan"]["pp"] for e in top} == {1}, [e["plan"]["pp"] for e in top]
