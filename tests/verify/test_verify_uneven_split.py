"""An uneven pipeline split (issue: training per stack) runs as planned: the first stage holds
the layers the plan gives it, and each stage's measured weights match the prediction for its
own layers; a chunk left with only the embedding or the loss is refused before anything starts."""

from __future__ import annotations

import pytest
from test_verify import TRAIN, _plan, _verify

from shardplan.cost.layout import Layout
from shardplan.cost.weights import stage_weights
from shardplan.cost.workload import Quantization
from shardplan.errors import CannotVerify, EXIT_OK
from shardplan.specs.loading import load_model
from shardplan.units import DType
from shardplan.verify.runspec import check_runnable


def test_stage_weights_follow_the_split():
    spec = load_model("llama-3.1-8b").spec  # 32 layers
    even = Layout(pp=4, dp=1)
    first3 = Layout(pp=4, dp=1, pp_first_stage_layers=3)
    kw = dict(quantization=Quantization.NONE, dense_dtype=DType.BF16)
    block = (stage_weights(spec, even, 1, **kw).numel) / 8  # stage 1: 8 decoder layers, nothing else
    assert stage_weights(spec, first3, 0, **kw).numel == pytest.approx(stage_weights(spec, even, 0, **kw).numel - 5 * block)
    assert stage_weights(spec, first3, 1, **kw).numel == pytest.approx(block * (29 // 3 + 1))  # 29 over 3: 10, 10, 9


@pytest.mark.dist
def test_verify_runs_the_first_stage_with_the_layers_the_plan_gives_it(cli, tmp_path):
    plan = _plan(tmp_path, 2, TRAIN, pp=2, dp=1, pp_first_stage_layers=3, micro_batch_size=2)
    res, report = _verify(cli, plan, tmp_path)
    assert res.exit_code == EXIT_OK, res.stderr
    weights = {r["stage"]: next(c for c in r["components"] if c["component"] == "weights") for r in report["ranks"]}
    assert weights[0]["measured_bytes"] < weights[1]["measured_bytes"]  # 3 layers and the embedding vs 5 and the head
    for w in weights.values():
        assert abs(w["relative_error"]) <= 0.02


def test_a_chunk_with_only_the_embedding_is_refused():
    spec = load_model("debug").spec
    layout = Layout(pp=2, virtual_stages=spec.num_layers // 2 + 1, pp_schedule="interleaved",
                    pp_embedding_as_layer=True, pp_loss_as_layer=True)
    with pytest.raises(CannotVerify) as e:
        check_runnable(spec, layout)
    assert e.value.field == "layout.pp_embedding_as_layer"


def test_a_rendezvous_lost_before_any_rank_started_is_retried_and_nothing_else(tmp_path):
    """A concurrent launcher can take the port picked for torchrun's store: a failure in the
    rendezvous, with no rank started, is launched again; a rank's own failure is not."""
    from shardplan.verify.launch import RENDEZVOUS_ATTEMPTS, _lost_rendezvous

    log = tmp_path / "torchrun.log"
    log.write_text("torch.distributed.elastic.rendezvous.api.RendezvousConnectionError: The connection to the C10d "
                   "store has failed.")
    assert RENDEZVOUS_ATTEMPTS == 2
    assert _lost_rendezvous(1, [], log)
    assert not _lost_rendezvous(1, [{"rank": 0, "pid": 123, "state": "failed"}], log)  # a rank ran
    assert not _lost_rendezvous(None, [], log) and not _lost_rendezvous(0, [], log)  # timed out / succeeded
    log.write_text("ValueError: something in a rank")
    assert not _lost_rendezvous(1, [], log)
