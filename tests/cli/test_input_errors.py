"""Bad input: one line naming the file, the field and the fix; exit 2; no traceback."""

from __future__ import annotations

import json

import pytest

LLAMA = {
    "model_type": "llama",
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "vocab_size": 1000,
    "max_position_embeddings": 256,
}


def _assert_one_line_error(res, *needles):
    assert res.exit_code == 2, (res.exit_code, res.stderr)
    assert "Traceback" not in res.stderr
    lines = [l for l in res.stderr.strip().splitlines() if l.strip()]
    assert len(lines) == 1, res.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])


def _write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_malformed_json(cli, tmp_path):
    p = _write(tmp_path, "config.json", '{"model_type": "llama", "hidden_size": ')
    _assert_one_line_error(cli("models", "show", str(p)), str(p), "invalid JSON", "line 1")


def test_malformed_yaml(cli, tmp_path):
    p = _write(tmp_path, "m.yaml", "name: x\narchitecture: [unclosed\n")
    _assert_one_line_error(cli("models", "show", str(p)), str(p), "invalid YAML", "line")


def test_duplicate_yaml_key(cli, tmp_path):
    p = _write(tmp_path, "m.yaml", "name: x\nname: y\narchitecture: {}\n")
    _assert_one_line_error(cli("models", "show", str(p)), "duplicate key 'name'")


def test_unknown_key_suggests_the_right_one(cli, tmp_path):
    p = _write(
        tmp_path,
        "m.yaml",
        "name: x\narchitecture:\n  vocab_size: 10\n  hiden_size: 64\n  num_layers: 1\n"
        "  num_attention_heads: 4\n  intermediate_size: 8\n  max_position_embeddings: 8\n",
    )
    _assert_one_line_error(cli("models", "show", str(p)), str(p), "architecture.hiden_size", "unknown key", "hidden_size")


@pytest.mark.parametrize(
    "patch,field,needle",
    [
        ({"hidden_size": 0}, "hf_config.hidden_size", "greater than 0"),
        ({"vocab_size": -5}, "hf_config.vocab_size", "greater than 0"),
        ({"num_hidden_layers": None}, "hf_config.num_hidden_layers", "missing"),
        ({"hidden_size": 500}, None, "head_dim"),
        ({"num_key_value_heads": 3}, None, "num_key_value_heads"),
    ],
)
def test_impossible_fields_in_bundled_style_file(cli, tmp_path, patch, field, needle):
    cfg = {**LLAMA, **patch}
    body = {"name": "bad", "sources": {"config": "test"}, "hf_config": cfg}
    p = _write(tmp_path, "bad.yaml", json.dumps(body))  # JSON is valid YAML
    res = cli("models", "show", str(p))
    _assert_one_line_error(res, str(p), needle)
    if field:
        assert f"field '{field}'" in res.stderr


def test_heads_not_dividing_hidden_without_head_dim(cli, tmp_path):
    p = _write(tmp_path, "config.json", json.dumps({**LLAMA, "hidden_size": 500}))
    res = cli("models", "show", str(p))
    _assert_one_line_error(res, str(p), "not divisible", "set head_dim")


def test_more_experts_per_token_than_experts(cli, tmp_path):
    cfg = {**LLAMA, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 8}
    p = _write(tmp_path, "config.json", json.dumps(cfg))
    _assert_one_line_error(cli("models", "show", str(p)), "num_experts_per_token (8) exceeds num_experts (4)")


def test_unsupported_model_type_names_the_fields(cli, tmp_path):
    p = _write(tmp_path, "config.json", json.dumps({**LLAMA, "model_type": "mamba", "architectures": ["MambaForCausalLM"]}))
    _assert_one_line_error(cli("models", "show", str(p)), "unsupported model_type 'mamba'", "hidden_size", "num_layers")


def test_unknown_model_name_suggests_close_names(cli):
    _assert_one_line_error(cli("models", "show", "llama-3.1-7b"), "unknown model 'llama-3.1-7b'", "llama-3.1-8b")


def test_unknown_hardware_name_suggests_close_names(cli):
    _assert_one_line_error(cli("hardware", "show", "h100-sxm"), "unknown hardware", "h100-sxm-80gb")


def test_hardware_profile_errors(cli, tmp_path):
    from conftest import REPO

    good = (REPO / "hardware_profiles" / "h100-sxm-80gb.yaml").read_text()
    p = _write(tmp_path, "hw.yaml", good.replace("memory_capacity_gib:", "memory_capacity_gb:", 1))
    _assert_one_line_error(cli("hardware", "show", str(p)), "gpu.memory_capacity_gb", "unknown key", "memory_capacity_gib")
    p = _write(tmp_path, "hw2.yaml", good.replace("gpus_per_node: 8", "gpus_per_node: 0", 1))
    _assert_one_line_error(cli("hardware", "show", str(p)), "node.gpus_per_node", "greater than 0")


def test_not_utf8_and_not_a_mapping(cli, tmp_path):
    p = tmp_path / "config.json"
    p.write_bytes(b'{"model_type": "\xff\xfe"}')
    _assert_one_line_error(cli("models", "show", str(p)), "not UTF-8")
    p2 = _write(tmp_path, "list.yaml", "- 1\n- 2\n")
    _assert_one_line_error(cli("models", "show", str(p2)), "expected a mapping")


def test_nan_in_json_is_rejected(cli, tmp_path):
    p = _write(tmp_path, "config.json", json.dumps(LLAMA).replace("256", "NaN"))
    _assert_one_line_error(cli("models", "show", str(p)), "NaN")


def test_debug_env_shows_traceback(cli, tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDPLAN_DEBUG", "1")
    p = _write(tmp_path, "config.json", "{")
    res = cli("models", "show", str(p))
    assert res.exit_code == 2 and "Traceback" in res.stderr


def test_an_integer_past_pythons_digit_limit_is_named_as_such(cli, tmp_path):
    """Python's own message names an interpreter setting (sys.set_int_max_str_digits), not the file's problem."""
    p = _write(tmp_path, "config.json", '{"model_type": "llama", "hidden_size": ' + "1" * 5000 + "}")
    res = cli("models", "show", str(p))
    _assert_one_line_error(res, str(p), "an integer of more than 4,300 digits")
    assert "set_int_max_str_digits" not in res.stderr


def test_a_one_token_context_asks_for_a_longer_one_not_the_same_request(cli):
    """A context of 1 token holds no request: the fix is a longer context, not --input-len 1 --output-len 1."""
    res = cli("estimate", "debug", "--max-model-len", "1", "--input-len", "1", "--output-len", "1")
    _assert_one_line_error(res, "'--max-model-len'", "raise --max-model-len to 2 or more")
