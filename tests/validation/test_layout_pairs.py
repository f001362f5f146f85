"""The model's error in comparing two layouts of one setting (validation.predict.layout_pairs), the
band the search's ties use (tasks/_bands.py), and what it changes in a ranking."""

from __future__ import annotations

import pytest

from shardplan.specs.cases import TrainingCase, TrainingMeasured
from shardplan.validation.predict import PAIRS_GROUP, Comparison, layout_pairs, shipped_predictions
from shardplan.validation.shipped import CORPUS_DIR

URL = "https://github.com/NVIDIA/Megatron-LM/blob/d98e8a64ddf34856e74b24714e3bedb2f5a39553/tests/x/{}.json"


def _case(id_: str, url: str, tokens: float, **layout) -> TrainingCase:
    fields = dict(tp=1, pp=1, dp=8, micro_batch=1, recompute="none") | layout
    return TrainingCase(id=id_, source=f"{url} (a table row)", stack="megatron", model="llama-3.1-8b",
                        hardware="h100-sxm-80gb", gpus=8, seq_len=4096, global_batch=64,
                        measured=TrainingMeasured(tokens_per_second_per_gpu=tokens), **fields)


def _tokens(case: TrainingCase, predicted: float) -> tuple[TrainingCase, Comparison]:
    return case, Comparison(case.id, case.source, "training", "megatron", None, "tokens_per_second",
                            case.measured.tokens_per_second_per_gpu, predicted)


def test_two_layouts_of_one_setting_pair_the_faster_first():
    a = _case("a", URL.format("a"), 1000.0, tp=2, dp=4)
    b = _case("b", URL.format("b"), 1250.0)  # the same repository at the same commit: one build
    pairs = layout_pairs([_tokens(a, 1100.0), _tokens(b, 1210.0)])
    assert len(pairs) == 1
    p = pairs[0]
    assert p.case_id == "b vs a" and p.group == PAIRS_GROUP and p.quantity == "layout_speed_ratio"
    assert p.measured == pytest.approx(1.25) and p.predicted == pytest.approx(1.1)
    assert p.error == pytest.approx(1.1 / 1.25 - 1)


def test_each_run_pairs_with_the_fastest_of_its_setting():
    """n runs of one setting make n - 1 pairs, not n(n - 1)/2: a hostile cases file stays linear."""
    runs = [_case(f"r{i}", URL.format(i), 1000.0 + 10 * i, tp=1 + i % 2, dp=8 // (1 + i % 2), micro_batch=1 + i)
            for i in range(6)]
    pairs = layout_pairs([_tokens(r, 900.0) for r in runs])
    assert [p.case_id for p in pairs] == [f"r5 vs r{i}" for i in range(4, -1, -1)]  # the next fastest first
    assert [p.measured for p in pairs] == pytest.approx([1050.0 / (1000.0 + 10 * i) for i in range(4, -1, -1)])
    assert all(p.predicted == 1.0 for p in pairs)


@pytest.mark.parametrize("other, why", [
    (dict(id_="b", url=URL.format("b"), tokens=1250.0), "the same layout: what differs is not stated"),
    (dict(id_="b", url=URL.replace("d98e8a64ddf34856e74b24714e3bedb2f5a39553", "0" * 40).format("b"), tokens=1250.0,
          tp=2, dp=4), "another commit: another build"),
    (dict(id_="b", url="https://example.org/another-report", tokens=1250.0, tp=2, dp=4), "another publication"),
])
def test_runs_that_do_not_compare_layouts_make_no_pair(other, why):
    a = _case("a", URL.format("a"), 1000.0)
    b = _case(other.pop("id_"), other.pop("url"), other.pop("tokens"), **other)
    assert layout_pairs([_tokens(a, 1100.0), _tokens(b, 1210.0)]) == [], why


def test_a_shape_written_in_another_order_is_the_same_setting():
    shape = dict(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256, family="llama")
    a = TrainingCase(**(_case("a", URL.format("a"), 1000.0).model_dump() | {"model": None, "shape": shape}))
    b = TrainingCase(**(_case("b", URL.format("b"), 1250.0, tp=2, dp=4).model_dump()
                        | {"model": None, "shape": dict(reversed(list(shape.items())))}))
    assert [p.case_id for p in layout_pairs([_tokens(a, 1100.0), _tokens(b, 1210.0)])] == ["b vs a"]


def test_another_feature_is_not_a_layout():
    a = _case("a", URL.format("a"), 1000.0)
    b = TrainingCase(**(_case("b", URL.format("b"), 1250.0, tp=2, dp=4).model_dump() | {"fp8": True}))
    assert layout_pairs([_tokens(a, 1100.0), _tokens(b, 1210.0)]) == []


def test_the_shipped_pairs_are_the_publications_own_ratios():
    """Each measured ratio is the two runs' own figures as published: Megatron-LM's CI golden values
    (iteration seconds of its gpt3_7b tp4_pp1 and tp1_pp4 memory-speed tests at one commit, H100 and
    A100) and ms-swift's Megatron-SWIFT benchmark (DeepSpeed ZeRO-2 against ZeRO-3, seconds per step)."""
    predicted = shipped_predictions(CORPUS_DIR)[0]
    pairs = {c.case_id: c for c in layout_pairs([(p.case, c) for p in predicted for c in p.comparisons])}
    expected = {
        "mcore_ci_7b_tp4pp1_h100 vs mcore_ci_7b_tp1pp4vp8_h100": 1.150 / 1.115,
        "mcore_ci_7b_tp4pp1_a100 vs mcore_ci_7b_tp1pp4vp8_a100": 2.942 / 2.587,
        "swift_qwen25_14b_8k_z2_8xa800 vs swift_qwen25_14b_8k_z3_8xa800": 10.56 / 10.32,
        # The same 7B pair's golden values on CoreWeave's H100s (both files at Megatron-LM a07e00b).
        "mcore_ci_7b_tp4pp1_h100_coreweave vs mcore_ci_7b_tp1pp4vp8_h100_coreweave": 1.1745 / 1.1191,
    }
    assert set(pairs) == set(expected)
    for case_id, ratio in expected.items():
        assert pairs[case_id].measured == pytest.approx(ratio, rel=2e-3), case_id
        # The model's ratio is within 9% of each measured one.
        assert abs(pairs[case_id].error) < 0.09, case_id


def test_validate_lists_the_pairs_as_their_own_group(cli):
    res = cli("validate", "--stack", "megatron", "--json")
    assert res.exit_code == 0, res.stderr
    d = res.json()
    group = next(g for g in d["groups"] if g["group"] == PAIRS_GROUP)
    assert group["quantity"] == "layout_speed_ratio" and group["num_cases"] == 3
    rows = [c for c in d["cases"] if c["group"] == PAIRS_GROUP]
    assert {r["case_id"] for r in rows} == {"mcore_ci_7b_tp4pp1_h100 vs mcore_ci_7b_tp1pp4vp8_h100",
                                            "mcore_ci_7b_tp4pp1_a100 vs mcore_ci_7b_tp1pp4vp8_a100",
                                            "mcore_ci_7b_tp4pp1_h100_coreweave vs mcore_ci_7b_tp1pp4vp8_h100_coreweave"}
    # The pairs are not cases of their own.
    assert d["num_cases"] == len({c["case_id"] for c in d["cases"] if c["group"] != PAIRS_GROUP})
    table = cli("validate", "--stack", "megatron")
    assert table.exit_code == 0, table.stderr
    row = next(line for line in table.stdout.splitlines() if "layouts" in line)
    assert "one layout / another" in row and f"{100 * group['band_abs_error']:.1f}%" in row


def test_a_training_search_ties_within_the_layout_band():
    """The search's ties for a training workload use the layout band, not the stack's tokens/s band."""
    from shardplan.cost.workload import TrainingWorkload
    from shardplan.knowledge.load import bands_file
    from shardplan.search import Goal, Objective
    from shardplan.specs.loading import load_hardware
    from shardplan.tasks._bands import goal_at_edge

    layouts = bands_file().band("training", PAIRS_GROUP, "layout_speed_ratio")
    speed = bands_file().band("training", "megatron", "tokens_per_second")
    assert layouts is not None and speed is not None and layouts.band_abs_error < speed.band_abs_error
    goal = goal_at_edge(Goal(Objective.STEP_TIME), TrainingWorkload(seq_len=4096, global_batch_size=64, stack="megatron"),
                        load_hardware("h100-sxm-80gb"), strict_fit=False)
    assert goal.tie_band_fraction == layouts.band_abs_error


@pytest.mark.slow
def test_the_pick_is_not_slower_than_the_layout_band_allows(cli):
    """Llama 3.1 405B on 2,048 H100s with Megatron's capabilities and no context parallelism: with
    the stack's ±44% tokens/s band as ties, tp=4 pp=16 dp=32 ranked first at 11.1 s a step (its
    smaller tensor-parallel group decided the tie), 21% slower than tp=8 pp=16 dp=16 at 9.2 s. Now the
    pick is within the layout band of the fastest plan that fits at the band's edge, and every plan it
    ties with is within that band of it."""
    from shardplan.knowledge.load import bands_file

    band = bands_file().band("training", PAIRS_GROUP, "layout_speed_ratio").band_abs_error  # type: ignore[union-attr]
    res = cli("recommend", "llama-3.1-405b", "--gpus", "2048", "--workload", "training", "--seq-len", "4096",
              "--global-batch-size", "1024", "--stack", "megatron", "--cp", "1", "--top", "6", "--json")
    assert res.exit_code == 0, res.stderr
    top = res.json()["top"]
    head = top[0]["objective_value"]
    edge = [t["objective_value"] for t in top if t["fit_at_band_edge"]["verdict"] == "fits"]
    assert head <= min(edge) * (1 + band) + 1e-9
    assert (top[0]["plan"]["tp"], top[0]["plan"]["pp"], top[0]["plan"]["dp"]) == (8, 16, 16)
    for t in top:
        if t["tie"]:
            assert abs(t["objective_value"] - head) <= band * head + 1e-9


def test_a_users_cases_pair_their_layouts(cli, tmp_path):
    """Two of a user's torchtitan runs of one setting, FSDP over 8 and tp 2 x FSDP 4: validate pairs
    them, the faster measured first, its predicted ratio the ratio of the two rows' predictions."""
    import yaml

    base = dict(kind="training", source="our cluster, job 12", stack="torchtitan", model="llama-3.1-8b",
                hardware="h100-sxm-80gb", gpus=8, zero_stage=3, micro_batch=1, seq_len=4096, global_batch=32,
                recompute="selective", flash_attention=True)
    fsdp = dict(base, id="fsdp8", dp=8, measured=dict(tokens_per_second_per_gpu=6000))
    tp2 = dict(base, id="tp2-fsdp4", tp=2, dp=4, measured=dict(tokens_per_second_per_gpu=5000))
    path = tmp_path / "cases.yaml"
    path.write_text(yaml.safe_dump({"cases": [tp2, fsdp]}))
    res = cli("validate", "--cases", path, "--json")
    assert res.exit_code == 0, res.stderr
    d = res.json()
    rows = {c["case_id"]: c for c in d["cases"]}
    pair = rows["fsdp8 vs tp2-fsdp4"]
    assert pair["group"] == PAIRS_GROUP and pair["measured"] == pytest.approx(6000 / 5000)
    assert pair["predicted"] == pytest.approx(rows["fsdp8"]["predicted"] / rows["tp2-fsdp4"]["predicted"], rel=1e-12)
    assert d["num_cases"] == 2
