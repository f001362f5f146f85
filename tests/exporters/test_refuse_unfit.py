"""Every export target refuses a plan that does not fit (PlanDoesNotFit, exit 3), serving and
training plans alike, with a message that reads well with or without the plan's reason; the one
exception, a serving plan short only of one sequence's KV cache, stays with the serving engines
that resize their memory share for it."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import build_plan

from shardplan.cost.layout import Layout
from shardplan.cost.workload import InferenceWorkload, TrainingWorkload
from shardplan.errors import EXIT_DOES_NOT_FIT
from shardplan.exporters import TARGETS, ExportOptions, PlanDoesNotFit, export
from shardplan.plan.manifest import write_manifest


def _fitting(kind: str):
    if kind == "serving":
        m, _ = build_plan("debug", 2, Layout(dp=2), InferenceWorkload(max_model_len=2048))
    else:
        m, _ = build_plan("debug", 4, Layout(dp=4), TrainingWorkload(seq_len=512, global_batch_size=64))
    assert m.predicted.fits
    return m


def _unfit(kind: str, reason: str | None = None):
    """A plan that fits, its manifest edited to say it does not (as a hand-edited file would)."""
    m = _fitting(kind)
    return m.model_copy(update={"predicted": m.predicted.model_copy(update={"fits": False, "reason": reason})})


@pytest.mark.parametrize("kind", ["serving", "training"])
@pytest.mark.parametrize("target", sorted(TARGETS))
def test_every_target_refuses_a_plan_that_does_not_fit(target, kind):
    with pytest.raises(PlanDoesNotFit) as info:
        export(_unfit(kind), target, options=ExportOptions())
    e = info.value
    assert e.exit_code == EXIT_DOES_NOT_FIT and e.field == "predicted.fits"
    assert e.message == f"the plan does not fit: what {target} launches from it would run out of memory"


@pytest.mark.parametrize("reason, shown", [
    (None, "the plan does not fit: "),
    ("", "the plan does not fit: "),
    ("  ", "the plan does not fit: "),
    ("stage 0 needs 94.5 GiB of 80 GiB", "the plan does not fit (stage 0 needs 94.5 GiB of 80 GiB): "),
])
def test_the_message_reads_well_with_or_without_a_reason(reason, shown):
    with pytest.raises(PlanDoesNotFit) as info:
        export(_unfit("training", reason), "torchrun")
    assert info.value.message.startswith(shown)
    assert "None" not in info.value.one_line() and "()" not in info.value.one_line()


def test_a_kv_cache_short_of_one_sequence_is_for_the_engines_to_resize():
    # llama-3.1-8b on an L4 at a 32K context: only the KV cache is short (of one 32,768-token sequence).
    m, _ = build_plan("llama-3.1-8b", 1, Layout(), InferenceWorkload(max_model_len=32768), hardware="l4-24gb")
    kv = m.predicted.kv_cache
    assert not m.predicted.fits and 0 < kv.capacity_tokens < kv.max_model_len_tokens
    assert [f.name for f in export(m, "vllm")] == ["serve.sh"]  # vLLM starts with a larger share
    for target in ("torchrun", "slurm", "jax"):  # nothing there resizes the memory
        with pytest.raises(PlanDoesNotFit, match="the plan does not fit \\(To serve at least one request"):
            export(m, target)


@pytest.mark.parametrize("target", ["torchrun", "slurm", "jax"])
def test_cli_exit_3_and_no_file_written(cli, tmp_path: Path, target):
    plan = tmp_path / "plan.yaml"
    write_manifest(_unfit("training"), plan)
    out = tmp_path / "out"
    r = cli("export", plan, "--to", target, "-o", out)
    assert r.exit_code == 3, r.stderr
    assert r.stderr.strip() == (f"error: {plan}: field 'predicted.fits': the plan does not fit: what {target} launches "
                                "from it would run out of memory (fix: re-run shardplan recommend and export its plan)")
    assert not out.exists() and r.stdout == ""
