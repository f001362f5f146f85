"""`shardplan replan`: the debug model from 16 to 8 GPUs and from 8 to 16, serving and training.
The new manifest loads; the move list gives every slice a new rank holds exactly one source
that really holds it; its bytes add up to what the new ranks hold, and agree with what the
new plan would read from a real safetensors checkpoint."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

import pytest
from conftest import build_plan
from safetensors.torch import save_file

from shardplan.cost.layout import Layout
from shardplan.cost.workload import InferenceWorkload, TrainingWorkload
from shardplan.plan.manifest import load_manifest, write_manifest
from shardplan.plan.placement import box_numel, model_tensors, rank_holdings
from shardplan.tasks.replan import intersect, subtract
from shardplan.specs.loading import load_model

SPEC = load_model("debug").spec
NUM_PARAMS = 5_247_232
BF16 = 2
ADAMW_STATE_BYTES = 12  # fp32 master weights, m and v per bf16 parameter (ZeRO paper's K)
SERVE = InferenceWorkload(max_model_len=512)
TRAIN = TrainingWorkload(seq_len=512, global_batch_size=64)


def _old(tmp_path: Path, gpus: int, layout: Layout, workload) -> Path:
    m, _ = build_plan("debug", gpus, layout, workload, gpus_per_node=8)
    path = tmp_path / "old.yaml"
    write_manifest(m, path)
    return path


def _replan(cli, old: Path, tmp_path: Path, *args: str) -> tuple[dict, dict, Path]:
    """Run replan -o new.yaml; the move list goes beside it as new.moves.json."""
    r = cli("replan", old, *args, "-o", tmp_path / "new.yaml", "--json")
    assert r.exit_code == 0, r.stderr
    out = r.json()
    assert out["manifest"] == str(tmp_path / "new.yaml")
    assert out["moves_file"] == str(tmp_path / "new.moves.json")
    return out, json.loads((tmp_path / "new.moves.json").read_text()), tmp_path / "new.yaml"


def _check_exact_cover(old_path: Path, new_path: Path, moves: dict) -> dict[str, float]:
    """Every slice of every new rank is covered by its pieces exactly once, and each piece comes
    from an old rank that holds it. Returns bytes held per state over all new ranks."""
    old, new = load_manifest(old_path), load_manifest(new_path)
    pieces = defaultdict(list)
    for mv in moves["moves"]:
        pieces[(mv["state"], mv["to_rank"], mv["tensor"])].append(mv)
        assert (mv["route"] == "local") == (mv["from_rank"] == mv["to_rank"])
    held_bytes = defaultdict(float)
    states = ("weights", "optimizer") if new.workload.kind == "training" else ("weights",)
    for state in states:
        old_boxes = [{h.tensor.name: h.box for h in held} for held in rank_holdings(old, SPEC, state)]
        for q, held in enumerate(rank_holdings(new, SPEC, state)):
            for h in held:
                got = pieces.pop((state, q, h.tensor.name))
                boxes = [tuple(map(tuple, mv["slice"])) for mv in got]
                assert sum(box_numel(b) for b in boxes) == box_numel(h.box), (state, q, h.tensor.name)
                rest = [h.box]
                for b in boxes:  # carving each piece out of what is left: overlaps or strays would fail here
                    assert sum(box_numel(intersect(r, b) or ((0, 0),)) for r in rest) == box_numel(b)
                    rest = [x for r in rest for x in subtract(r, b)]
                assert rest == []
                for mv, b in zip(got, boxes):
                    src = old_boxes[mv["from_rank"]].get(h.tensor.name)
                    assert src is not None and intersect(src, b) == b, mv
                held_bytes[state] += sum(mv["bytes"] for mv in got)
    assert not pieces, f"moves for slices the new plan does not hold: {list(pieces)[:3]}"
    moved = sum(mv["bytes"] for mv in moves["moves"] if mv["route"] != "local")
    kept = sum(mv["bytes"] for mv in moves["moves"] if mv["route"] == "local")
    assert moved == moves["moved_bytes"] and kept == moves["kept_bytes"]
    assert moved + kept == sum(held_bytes.values())
    return held_bytes


def test_serving_16_to_8(tmp_path, cli):
    old = _old(tmp_path, 16, Layout(tp=2, pp=2, dp=4), SERVE)
    out, moves, new = _replan(cli, old, tmp_path, "--gpus", "8")
    held = _check_exact_cover(old, new, moves)
    chosen = out["candidates"][out["chosen"] - 1]
    assert chosen["chosen"] and chosen["plan"]["tp"] * chosen["plan"]["pp"] * chosen["plan"]["dp"] == 8
    # the winner, dp=8 replicas of the whole model: 8 bf16 copies
    assert (chosen["plan"]["tp"], chosen["plan"]["pp"], chosen["plan"]["dp"]) == (1, 1, 8)
    assert held["weights"] == 8 * NUM_PARAMS * BF16 == 83_955_712
    # each new rank already holds a quarter of its old stage's half of the model on its GPU
    assert moves["kept_bytes"] == 21_004_288 and moves["moved_bytes"] == 62_951_424
    assert moves["moved_bytes_by_route"] == {"intra_node": 20_971_520, "inter_node": 41_979_904}
    assert out["moves"]["max_received_bytes_per_rank"] == 7_868_928
    # sends are spread over the old ranks that hold the same slice, not all taken from the lowest
    senders = {mv["from_rank"] for mv in moves["moves"] if mv["route"] == "inter_node"}
    assert senders == set(range(8, 16))


def test_serving_8_to_16_over_two_nodes(tmp_path, cli):
    old = _old(tmp_path, 8, Layout(tp=2, dp=4), SERVE)
    out, moves, new = _replan(cli, old, tmp_path, "--nodes", "2")
    assert load_manifest(new).hardware.num_nodes == 2
    held = _check_exact_cover(old, new, moves)
    assert out["to_num_gpus"] == 16 and out["from"]["num_gpus"] == 8
    ranks = out["moves"]["ranks"]
    assert len(ranks) == 16 and all(r["node"] == r["rank"] // 8 for r in ranks)
    chosen = out["candidates"][out["chosen"] - 1]["plan"]
    assert (chosen["tp"], chosen["pp"], chosen["dp"]) == (1, 1, 16)
    full_copy = NUM_PARAMS * BF16
    assert held["weights"] == 16 * full_copy
    # ranks 0-7 keep their tp=2 half (and the replicated norms) and fetch the other half next door;
    # the new node's GPUs held nothing, so each gets a whole copy from node 0
    assert all(r["kept_bytes"] == 0 and r["received_inter_node_bytes"] == full_copy for r in ranks[8:])
    assert moves["kept_bytes"] == 8 * (NUM_PARAMS + 8 * 2 * 256 + 256) == 42_012_672
    assert moves["moved_bytes_by_route"] == {"intra_node": 41_943_040, "inter_node": 8 * full_copy}
    assert moves["moved_bytes"] == sum(r["received_bytes"] for r in ranks) == 125_898_752


def test_training_moves_weights_and_optimizer_states(tmp_path, cli):
    old = _old(tmp_path, 16, Layout(tp=2, pp=2, dp=4, zero_stage=1), TRAIN)
    out, moves, new = _replan(cli, old, tmp_path, "--gpus", "8", "--margin", "0")
    m = load_manifest(new)
    held = _check_exact_cover(old, new, moves)
    assert out["chosen"] == 1  # margin 0: the best objective, whatever it moves
    L = m.layout
    # ZeRO >= 1 partitions the optimizer states: every element's state sits on one rank per tp slice
    replicas = 1 if L.zero_stage >= 1 else L.dp * L.cp
    norms_extra = (L.tp - 1) * (8 * 2 * 256 + 256)
    assert held["optimizer"] == ADAMW_STATE_BYTES * replicas * (NUM_PARAMS + norms_extra)
    assert set(moves["moved_bytes_by_state"]) == {"weights", "optimizer"}


def test_margin_picks_the_least_moving_layout_within_it(tmp_path, cli):
    old = _old(tmp_path, 16, Layout(tp=2, pp=2, dp=4, zero_stage=3), TRAIN)
    out, moves, new = _replan(cli, old, tmp_path, "--gpus", "8", "--margin", "0.05", "--top", "6")
    _check_exact_cover(old, new, moves)
    cands = out["candidates"]
    assert all((c["gap_fraction"] <= 0.05) == c["within_margin"] for c in cands)
    within = [c for c in cands if c["within_margin"]]
    chosen = next(c for c in cands if c["chosen"])
    assert chosen["moved_bytes"] == min(c["moved_bytes"] for c in within)
    assert chosen["moved_bytes"] < cands[0]["moved_bytes"]  # here a slower-by-<5% layout moves less
    assert out["moves"]["moved_bytes"] == chosen["moved_bytes"]


def test_moves_agree_with_the_checkpoint_plan_of_the_new_manifest(tmp_path, cli):
    """What a new rank holds (kept + received) is what it would read from a real checkpoint,
    at the plan's bf16 against the checkpoint's fp32."""
    old = _old(tmp_path, 16, Layout(tp=2, pp=2, dp=4), SERVE)
    r = cli("replan", old, "--gpus", "8", "-o", tmp_path / "new.yaml", "--moves", tmp_path / "moves.yaml", "--top", "3",
            "--json")
    assert r.exit_code == 0, r.stderr
    out, new = r.json(), tmp_path / "new.yaml"
    assert out["moves_file"] == str(tmp_path / "moves.yaml") and not (tmp_path / "new.moves.json").exists()
    import torch

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file({t.name: torch.zeros(t.shape) for t in model_tensors(SPEC)}, str(ckpt / "model.safetensors"))
    loads = cli("checkpoint", new, ckpt, "--json").json()
    for rk, plan_rank in zip(out["moves"]["ranks"], loads["ranks"]):
        assert (rk["kept_bytes"] + rk["received_bytes"]) * 4 / BF16 == plan_rank["bytes"]
    import yaml

    listed = yaml.safe_load((tmp_path / "moves.yaml").read_text())
    assert listed["moved_bytes"] == out["moves"]["moved_bytes"] and len(listed["moves"]) == out["moves"]["num_pieces"]


def test_table_output_and_bad_input(tmp_path, cli):
    old = _old(tmp_path, 16, Layout(tp=2, pp=2, dp=4), SERVE)
    r = cli("replan", old, "--gpus", "8")
    assert r.exit_code == 0 and "chosen" in r.stdout and "Per new rank" in r.stdout
    assert not list(tmp_path.glob("*.moves.*"))  # nothing written without -o / --moves
    r = cli("replan", old)
    assert r.exit_code == 2 and "--gpus N or --nodes N" in r.stderr
    r = cli("replan", old, "--gpus", "12")
    assert r.exit_code == 2 and "whole node" in r.stderr
    text = old.read_text().replace(load_manifest(old).model.spec_sha256, "0" * 64)
    (tmp_path / "edited.yaml").write_text(text)
    r = cli("replan", tmp_path / "edited.yaml", "--gpus", "8")
    assert r.exit_code == 2 and "field 'model.spec_sha256'" in r.stderr and "\n" not in r.stderr.strip()


def test_nothing_fits_exits_3(tmp_path, cli):
    m, _ = build_plan("llama-3.1-70b", 8, Layout(tp=8), InferenceWorkload(max_model_len=8192))
    write_manifest(m, tmp_path / "old.yaml")
    r = cli("replan", tmp_path / "old.yaml", "--gpus", "1", "--json")
    assert r.exit_code == 3
    out = r.json()
    assert out["chosen"] is None and out["candidates"] == [] and out["num_feasible"] == 0


@pytest.mark.parametrize("a,b,parts", [
    (((0, 4), (0, 4)), ((1, 3), (1, 3)), 4),
    (((0, 4), (0, 4)), ((0, 4), (2, 6)), 1),
    (((0, 4),), ((5, 6),), 1),
])
def test_box_subtraction_partitions(a, b, parts):
    rest = subtract(a, b)
    assert len(rest) == parts
    inter = intersect(a, b)
    assert sum(map(box_numel, rest)) + (box_numel(inter) if inter else 0) == math.prod(h - l for l, h in a)
