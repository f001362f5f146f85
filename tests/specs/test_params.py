"""Parameter counts: exact against published counts, per component, and derived figures."""

from __future__ import annotations

import json

import pytest
import yaml

from conftest import REPO, validation_file
from shardplan.cost.params import count_params
from shardplan.specs.loading import bundled_names, load_model, model_specs_dir

# params.yaml holds the config fields without model_type; these are the families they are.
FAMILY = {
    "llama-3.1-8b": "llama",
    "mistral-7b-v0.1": "mistral",
    "mixtral-8x7b-v0.1": "mixtral",
    "gpt2": "gpt2",
}


def _published():
    data = yaml.safe_load(validation_file("params.yaml").read_text())
    return sorted(data["models"].items())


@pytest.mark.parametrize("model_id,entry", _published(), ids=[k for k, _ in _published()])
def test_config_json_count_equals_published(cli, tmp_path, model_id, entry):
    cfg = dict(entry["config"], model_type=FAMILY[model_id])
    model_dir = tmp_path / model_id
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(cfg))
    res = cli("models", "show", str(model_dir / "config.json"), "--json")
    assert res.exit_code == 0, res.stderr
    out = res.json()
    assert out["num_params"] == entry["params_total"]
    assert sum(out["params_by_component"].values()) == out["num_params"]
    for key in ("name", "num_active_params", "params_by_component", "kv_cache_bytes_per_token"):
        assert key in out
    # A directory holding config.json loads the same model.
    assert cli("models", "show", str(model_dir), "--json").json()["num_params"] == entry["params_total"]


def test_mixtral_active_params_match_mistral_figure(cli, tmp_path):
    entry = dict(_published())["mixtral-8x7b-v0.1"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(entry["config"], model_type="mixtral")))
    out = cli("models", "show", str(path), "--json").json()
    # Mistral's blog: 12.9B active of 46.7B. Active = total - 6 idle experts x 32 layers x 3 x 4096 x 14336.
    assert out["num_active_params"] == entry["params_total"] - 32 * 6 * 3 * 4096 * 14336
    assert round(out["num_active_params"] / 1e9, 1) == 12.9


BUNDLED = bundled_names(model_specs_dir())


def test_every_required_bundled_spec_exists():
    required = {
        "llama-3.1-8b", "llama-3.1-70b", "llama-3.1-405b", "llama-3.2-1b", "mistral-7b", "mixtral-8x7b",
        "mixtral-8x22b", "qwen2.5-7b", "qwen2.5-72b", "qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3",
        "gemma-2-9b", "gemma-2-27b", "gpt2", "gpt-neox-20b", "falcon-40b", "gpt3-175b", "debug",
    }
    assert required <= set(BUNDLED)


@pytest.mark.parametrize("name", BUNDLED)
def test_bundled_spec_matches_its_published_count_and_sums(name):
    m = load_model(name)
    counts = count_params(m.spec)
    assert sum(counts.by_component.values()) == counts.total
    assert 0 < counts.active_per_token <= counts.total
    assert m.sources, f"{name} records no source"
    if m.published_num_params is not None:
        assert counts.total == m.published_num_params


def test_kv_bytes_per_token(cli):
    # Llama-3.1-8B: 32 layers x 8 KV heads x 128 x (K and V) x 2 bytes.
    assert cli("models", "show", "llama-3.1-8b", "--json").json()["kv_cache_bytes_per_token"] == 32 * 8 * 128 * 2 * 2
    # DeepSeek-V3 MLA: (kv_lora_rank 512 + rope 64) x 61 layers x 2 bytes, shared by all heads.
    out = cli("models", "show", "deepseek-v3", "--json").json()
    assert out["kv_cache_bytes_per_token"] == (512 + 64) * 61 * 2
    assert out["derived"]["attention_kind"] == "mla"


def test_deepseek_v3_totals():
    counts = count_params(load_model("deepseek-v3").spec)
    # DeepSeek-V3 report: 671B total, 37B activated per token (their figure leaves out the
    # embedding table, 129280 x 7168 = 0.93B, which ours counts); the MTP module has 11.5B
    # unique parameters (685B on disk with its copies of embedding and head).
    assert round(counts.total / 1e9) == 671
    embedding = counts.by_component["embedding"]
    assert embedding == 129280 * 7168
    assert round((counts.active_per_token - embedding) / 1e9) == 37
    assert round(counts.mtp / 1e9, 1) == 11.6
    # On disk: 684.5B weights + the fp8 block scales the loader does not count as parameters.
    assert 684e9 < counts.total + counts.mtp + 2 * embedding < 685e9


def test_gemma2_layout():
    spec = load_model("gemma-2-9b").spec
    assert spec.num_sliding_layers == spec.num_layers // 2
    assert spec.is_sliding_layer(0) and not spec.is_sliding_layer(1)
    assert spec.num_norms_per_layer == 4 and spec.tie_word_embeddings


def test_models_list_json_covers_every_bundled_spec(cli):
    res = cli("models", "--json")
    assert res.exit_code == 0
    assert sorted(r["name"] for r in res.json()) == sorted(load_model(n).spec.name for n in BUNDLED)


def test_cost_package_imports_no_io_libraries():
    import ast

    banned = {"yaml", "rich", "typer", "torch", "json"}
    for path in (REPO / "shardplan" / "cost").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module.split(".")[0]]
            assert not banned & set(names), f"{path.name} imports {banned & set(names)}"
