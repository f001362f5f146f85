"""`--engine-version` picks the bundled flag list an export is checked against (issue 26): the plan's
version (or `export --engine-version`) chooses the newest bundled list not newer than it; the image
tag and every flag follow that list, and the header says which list and why."""

from __future__ import annotations

import pytest
import yaml
from test_export import check_flags, engine_commands, files, plan, pod_shells

from shardplan.errors import ShardplanError
from shardplan.exporters import ExportOptions, export
from shardplan.exporters.base import PINNED_VERSIONS, bundled_versions, choose_version, flag_table
from shardplan.plan.schema import SpeculativeSection

PLANS = ["serve-1gpu", "serve-1node", "serve-2node-span", "serve-dp-ep-1node", "serve-dp-ep-2node"]
PROGRAMS = {"vllm": "vllm", "sglang": "sglang"}


def planned_for(name: str, engine: str, version: str, **workload):
    """A grid plan as `recommend --engine E --engine-version V` writes it (the exporters read only these fields)."""
    m = plan(name)
    return m.model_copy(update={"workload": m.workload.model_copy(update={"engine": engine, "engine_version": version,
                                                                          **workload})})


def exported(m, target: str, **opts) -> dict[str, str]:
    return {f.name: f.text for f in export(m, target, options=ExportOptions(plan_file="plan.yaml", **opts))}


def checked_flags(texts: dict[str, str], target: str, list_name: str) -> int:
    """Every flag of every `target` command in the files, checked against `list_name` (choices too)."""
    n = 0
    for fname, text in texts.items():
        for shell in pod_shells(text) if fname.endswith(".yaml") else [text]:
            for table, args in engine_commands(shell):
                if table == PROGRAMS.get(target, target):
                    n += check_flags(list_name, args)
    return n


# ----- the rule ---------------------------------------------------------------------------------


@pytest.mark.parametrize("wanted,version,why", [
    (None, "0.33.0", "the pinned version: nothing named"),
    ("0.11.0", "0.11.0", "the plan's 0.11.0"),
    ("0.20.1", "0.11.0", "the newest bundled list not newer than the plan's 0.20.1"),
    ("0.33.0", "0.33.0", "the plan's 0.33.0"),
    ("0.40.0", "0.33.0", "the pinned and newest bundled list: the plan's 0.40.0 is newer"),
    ("0.8.5", "0.11.0", "the oldest bundled list: the plan's 0.8.5 is older than every bundled list"),
])
def test_the_newest_bundled_list_not_newer_than_the_version_is_chosen(wanted, version, why):
    got, reason = choose_version(["0.11.0", "0.33.0"], "0.33.0", wanted,
                                 asked_by="nothing named" if wanted is None else "the plan's")
    assert got == version and reason.startswith(why)


def test_versions_compare_as_numbers_not_text():
    assert bundled_versions("sglang") == ["0.5.3", "0.5.23"]  # "0.5.23" < "0.5.3" as text
    assert choose_version(["0.5.3", "0.5.23"], "0.5.23", "0.5.10", asked_by="x")[0] == "0.5.3"
    assert bundled_versions("tgi") == ["3.2.0", "3.3.7"]
    assert bundled_versions("vllm") == ["0.11.0", "0.33.0"]


@pytest.mark.parametrize("text", ["latest", "0.11.0; rm -rf /", "0.11.0\n# injected", "1.2.3.4.5", "0.11.0 && id"])
def test_a_version_that_is_not_one_is_refused_naming_the_option(text):
    """A version is X.Y[.Z[.W]] with at most a release suffix (post1, rc8, +cu124): a prefix that
    parses is not enough, so nothing after it reaches a header or a manifest."""
    with pytest.raises(ShardplanError) as e:
        choose_version(["0.11.0"], "0.11.0", text, asked_by="x")
    assert e.value.field == "--engine-version"


def test_hostile_engine_versions_are_one_line_exit_2_on_estimate_and_export(cli, tmp_path):
    bad = "0.10.2; rm -rf /"
    res = cli("estimate", "llama-3.1-8b", "--gpus", "1", "--engine-version", bad)
    assert res.exit_code == 2 and "--engine-version" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    p = tmp_path / "p.yaml"
    assert cli("recommend", "llama-3.1-8b", "--gpus", "1", "--objective", "throughput", "-o", str(p)).exit_code == 0
    res = cli("export", str(p), "--to", "vllm", "--engine-version", "0.11.0; rm -rf /")
    assert res.exit_code == 2 and "--engine-version" in res.stderr and "rm -rf" not in res.stdout


# ----- exports of the same plan at two versions ----------------------------------------------

CASES = [("vllm", "0.11.0", "vllm/vllm-openai:v0.11.0"), ("vllm", "0.33.0", "vllm/vllm-openai:v0.33.0"),
         ("sglang", "0.5.3", "lmsysorg/sglang:v0.5.3"), ("sglang", "0.5.23", "lmsysorg/sglang:v0.5.23")]


@pytest.mark.parametrize("engine,version,image", CASES)
def test_every_flag_is_checked_against_the_plans_versions_list_and_the_image_is_that_versions(engine, version, image):
    listed = f"{engine}-{version}"
    n = 0
    for name in PLANS:
        m = planned_for(name, engine, version)
        out = exported(m, engine)
        n += checked_flags(out, engine, listed)
        text = out["serve.sh"]
        display = {"vllm": "vLLM", "sglang": "SGLang"}[engine]
        assert f"# flags checked against {display} {version} (the plan's --engine-version {version}; " \
               f"https://pypi.org/project/{engine}/{version}/)" in text
        assert "note: planned for" not in text  # the chosen list is the plan's own version
        pods = exported(m, "kubernetes", engine=engine)
        n += checked_flags(pods, engine, listed)
        images = {c["image"] for t in pods.values() for doc in yaml.safe_load_all(t) for c in _containers(doc)}
        assert images == {image}, images
    assert n >= 40, n


def _containers(node):
    if isinstance(node, dict):
        yield from node.get("containers", [])
        for v in node.values():
            yield from _containers(v)
    elif isinstance(node, list):
        for v in node:
            yield from _containers(v)


def test_the_flags_an_exporter_emits_follow_the_chosen_sglang_list():
    eager = {v: planned_for("serve-dp-ep-1node", "sglang", v, enforce_eager=True) for v in ("0.5.3", "0.5.23")}
    old, new = (exported(eager[v], "sglang")["serve.sh"] for v in ("0.5.3", "0.5.23"))
    assert "--enable-dp-attention" in old and "--disable-cuda-graph" in old and "--attn-dp-size" not in old
    assert "--attn-dp-size 4" in new and "--cuda-graph-backend-decode disabled" in new
    assert "--enable-dp-attention" not in new and "--disable-cuda-graph" not in new  # deprecated in 0.5.23
    assert "attn-dp-size" not in flag_table("sglang-0.5.3").flags  # so 0.5.3's export cannot use it


def test_a_draft_model_plan_follows_the_chosen_vllm_list():
    from shardplan.exporters.base import CannotExpress

    sp = {"method": "draft_model", "num_speculative_tokens": 3, "draft_model": "llama-3.2-1b",
          "draft_hf_id": "meta-llama/Llama-3.2-1B"}
    speculative = SpeculativeSection.model_validate(sp)
    with pytest.raises(CannotExpress, match="vLLM 0.11.0 does not run a separate draft model"):
        exported(planned_for("serve-1gpu", "vllm", "0.11.0", speculative=speculative), "vllm")
    assert '"method": "draft_model"' in exported(planned_for("serve-1gpu", "vllm", "0.33.0", speculative=speculative),
                                                 "vllm")["serve.sh"]


def test_export_engine_version_overrides_the_plan_and_says_the_memory_rules_differ():
    m = planned_for("serve-1node", "vllm", "0.33.0")
    text = exported(m, "vllm", engine_version="0.11.0")["serve.sh"]
    assert "# flags checked against vLLM 0.11.0 (export --engine-version 0.11.0; " in text
    assert "note: memory sized for vllm 0.33.0's rules, flags are 0.11.0's" in text
    assert checked_flags({"serve.sh": text}, "vllm", "vllm-0.11.0") > 5


def test_a_plan_newer_than_the_pin_or_older_than_every_list_says_which_list_it_got():
    newer = exported(planned_for("serve-1gpu", "vllm", "0.40.1"), "vllm")["serve.sh"]
    assert f"vLLM {PINNED_VERSIONS['vllm']} (the pinned and newest bundled list: the plan's --engine-version 0.40.1 is newer" in newer
    older = exported(planned_for("serve-1gpu", "sglang", "0.4.6"), "sglang")["serve.sh"]
    assert "SGLang 0.5.3 (the oldest bundled list: the plan's --engine-version 0.4.6 is older than every bundled list" in older
    between = exported(planned_for("serve-1gpu", "tgi", "3.2.3"), "tgi")["serve.sh"]
    assert "TGI 3.2.0 (the newest bundled list not newer than the plan's --engine-version 3.2.3" in between


def test_a_plan_at_the_newest_rules_known_exports_for_the_pinned_release():
    """Every plan made without --engine-version carries the newest rules shardplan knows (TGI 3.3.0);
    they hold for later releases as far as shardplan knows, so the export is for the pin. Where the newest
    rules are the pin's own release (vLLM 0.33.0, SGLang 0.5.23) the flags are that release's, as the plan's."""
    from shardplan.knowledge.load import engine_file

    newest = engine_file("tgi").newest
    assert newest != PINNED_VERSIONS["tgi"]
    text = exported(planned_for("serve-1gpu", "tgi", newest), "tgi")["serve.sh"]
    assert f"{PINNED_VERSIONS['tgi']} (the pinned version: the plan uses the newest tgi rules shardplan knows ({newest})" in text
    for engine, name in (("vllm", "vLLM"), ("sglang", "SGLang")):
        newest = engine_file(engine).newest
        assert newest == PINNED_VERSIONS[engine]
        text = exported(planned_for("serve-1gpu", engine, newest), engine)["serve.sh"]
        assert f"{name} {newest} (the plan's --engine-version {newest};" in text


def test_a_version_of_another_engine_is_not_applied():
    text = exported(planned_for("serve-1gpu", "vllm", "0.11.0"), "sglang")["serve.sh"]
    assert "SGLang 0.5.23 (the pinned version: the plan names vllm 0.11.0, not a sglang version;" in text


def test_the_cli_passes_export_engine_version(cli, tmp_path):
    from shardplan.plan.manifest import write_manifest

    path = tmp_path / "plan.yaml"
    write_manifest(planned_for("serve-1gpu", "sglang", "0.5.23"), path)
    r = cli("export", str(path), "--to", "sglang", "--engine-version", "0.5.3")
    assert r.exit_code == 0, r.stderr
    assert "SGLang 0.5.3 (export --engine-version 0.5.3;" in r.stdout
    bad = cli("export", str(path), "--to", "sglang", "--engine-version", "newest")
    assert bad.exit_code == 2 and "--engine-version" in bad.stderr
