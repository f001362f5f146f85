"""`shardplan estimate/recommend org/name[@revision]`: run through the real CLI against a real
huggingface_hub cache laid out in tmp_path, with HF_HUB_OFFLINE=1 (nothing reaches the
network). Uncached and hostile ids exit 2 with one line and no traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

COMMIT = "89abcdef0123456789abcdef0123456789abcdef"
SHORT = ("--input-len", "128", "--output-len", "32")  # the tiny model holds 256 tokens
TINY = {
    "model_type": "llama", "hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 2,
    "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 1000, "max_position_embeddings": 256,
    "torch_dtype": "bfloat16",
}
# 2 x 1000 x 512 (embeddings, untied head) + 2 layers x (q,o 2 x 512^2 + k,v 2 x 512 x 256 +
# mlp 3 x 512 x 1024 + norms 2 x 512) + final norm 512
TINY_NUM_PARAMS = 5_745_152


def _one_line_exit_2(res, *needles):
    assert res.exit_code == 2, (res.exit_code, res.stdout, res.stderr)
    assert "Traceback" not in res.stderr and res.stdout == ""
    lines = [ln for ln in res.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, res.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """models--org--tiny as `hf download org/tiny config.json` leaves it (blob + snapshot link + refs)."""
    repo = tmp_path / "hf-home" / "hub" / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / "c0ffee").write_text(json.dumps(TINY))
    snap = repo / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    (snap / "config.json").symlink_to(Path("../../blobs/c0ffee"))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # the cache is $HF_HOME/hub
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)  # relative ids are not also paths here
    return snap / "config.json"


def test_estimate_a_hub_id_from_the_cache(cli, cache):
    res = cli("estimate", "org/tiny", "--gpus", "1", *SHORT, "--json")
    assert res.exit_code == 0, res.stderr
    out = res.json()
    assert out["model"]["num_params"] == TINY_NUM_PARAMS
    # the same figures as the config file itself
    local = cli("estimate", str(cache.resolve()), "--gpus", "1", *SHORT, "--json").json()
    assert out["memory"] == local["memory"] and out["model"]["num_params"] == local["model"]["num_params"]


def test_a_pinned_commit_resolves_too(cli, cache):
    res = cli("estimate", f"org/tiny@{COMMIT}", "--gpus", "1", *SHORT, "--json")
    assert res.exit_code == 0, res.stderr
    assert res.json()["model"]["num_params"] == TINY_NUM_PARAMS


def test_recommend_records_the_id_and_commit_in_the_plan(cli, cache):
    res = cli("recommend", "org/tiny", "--gpus", "1", *SHORT, "-o", "plan.yaml")
    assert res.exit_code == 0, res.stderr
    model = yaml.safe_load(Path("plan.yaml").read_text())["model"]
    assert model["source"] == f"hf:org/tiny@{COMMIT}" and model["hf_id"] == "org/tiny"
    # the plan reads back through the same pinned commit (export re-checks the spec's hash)
    exported = cli("export", "plan.yaml", "--to", "vllm", "--json")
    assert exported.exit_code == 0, exported.stderr


def test_an_uncached_id_offline_is_one_line(cli, cache):
    line = _one_line_exit_2(cli("estimate", "org/absent"), "org/absent", "HF_HUB_OFFLINE", "hf download org/absent config.json")
    assert "run once online" in line


def test_an_uncached_revision_offline_is_one_line(cli, cache):
    _one_line_exit_2(cli("estimate", "org/tiny@v9"), "org/tiny@v9", "--revision v9")


@pytest.mark.parametrize("arg, words", [
    ("../../etc/passwd", "file not found"),
    ("/abs/path/x", "file not found"),
    ("https://huggingface.co/x/y", "a URL"),
    ("org/..", "'..'"),
    ("org/name@../x", "the revision must be"),
    ("org/name@ main", "the revision must be"),
    ("org/" + "n" * 500, "longer than"),
])
def test_hostile_ids_are_one_line_and_exit_2(cli, cache, arg, words):
    _one_line_exit_2(cli("estimate", arg), words)


def test_help_names_hub_ids(cli):
    out = cli("estimate", "--help").stdout
    assert "org/name@revision" in out and "meta-llama/Llama-3.1-8B" in out
