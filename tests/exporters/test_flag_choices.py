"""Choices an engine checks after parsing (issue 26): vLLM builds --quantization (and, in 0.33.0,
--kv-cache-dtype) without argparse choices, so tools/dump_engine_flags.py reads the values from the
release's own source (`choices_source`). The values the exporters emit are among them for both
bundled versions of each engine; a wrong one is refused naming the flag and the version; the `ast`
reader returns the right list on source copied from the releases."""

from __future__ import annotations

import pytest
from test_engine_flags import dump
from test_export import engine_commands, plan

from shardplan.exporters import ExportOptions, export, sglang, vllm
from shardplan.exporters.base import CannotExpress, flag_table

LISTS = {"vllm": ["vllm-0.11.0", "vllm-0.33.0"], "sglang": ["sglang-0.5.3", "sglang-0.5.23"]}
ALL_LISTS = [name for names in LISTS.values() for name in names]
QUANTIZATION_FILE = "vllm/model_executor/layers/quantization/__init__.py"


# ----- what the regenerated lists hold ----------------------------------------------------------


@pytest.mark.parametrize("name,flag,source", [
    ("vllm-0.11.0", "quantization", f"{QUANTIZATION_FILE} QuantizationMethods"),
    ("vllm-0.33.0", "quantization", f"{QUANTIZATION_FILE} QuantizationMethods"),
    ("vllm-0.33.0", "kv-cache-dtype", "vllm/config/cache.py CacheDType"),
])
def test_vllm_flags_checked_after_parsing_carry_choices_from_the_release_source(name, flag, source):
    spec = flag_table(name).flags[flag]
    assert spec["choices_source"] == source
    assert len(spec["choices"]) == len(set(spec["choices"])) >= 6 and "fp8" in spec["choices"]


def test_argparse_choices_are_kept_without_a_source():
    # vLLM 0.11.0 still builds --kv-cache-dtype with argparse choices; SGLang has argparse choices for all three
    kv = flag_table("vllm-0.11.0").flags["kv-cache-dtype"]
    assert kv["choices"][:2] == ["auto", "bfloat16"] and "choices_source" not in kv
    for name in LISTS["sglang"]:
        t = flag_table(name)
        for flag in ["quantization", "kv-cache-dtype", "attention-backend"]:
            assert t.flags[flag].get("choices") and "choices_source" not in t.flags[flag], (name, flag)
        assert not any("choices_source" in spec for spec in t.flags.values()), name


# ----- (1) what the exporters emit is among the choices ------------------------------------------


@pytest.mark.parametrize("name", ALL_LISTS)
def test_the_exporters_format_maps_name_values_of_every_bundled_version(name):
    t = flag_table(name)
    module = vllm if name.startswith("vllm") else sglang
    for value in module._QUANT.values():
        assert t.allows("quantization", value), (name, value)
    for value in (sglang._KV.values() if module is sglang else ["auto", "fp8"]):
        assert t.allows("kv-cache-dtype", value), (name, value)


def _emitted(target: str, version: str, weights: str | None, kv: str) -> dict[str, str]:
    """--quantization / --kv-cache-dtype as the export of a one-GPU bf16 plan writes them."""
    m = plan("serve-1gpu")
    m = m.model_copy(update={"layout": m.layout.model_copy(update={"weight_quantization": weights, "kv_cache_dtype": kv})})
    files = export(m, target, options=ExportOptions(plan_file="plan.yaml", engine_version=version))
    out: dict[str, str] = {}
    for f in files:
        assert f"flags checked against {'vLLM' if target == 'vllm' else 'SGLang'} {version} " in f.text
        for table, args in engine_commands(f.text):
            if table == target:
                out |= {a[2:]: args[i + 1] for i, a in enumerate(args) if a in ("--quantization", "--kv-cache-dtype")}
    return out


FORMATS = [(w, kv) for w in ["none", "fp8", "int8", "int4", "awq", "gptq"] for kv in ["bf16", "fp8", "fp16", "fp32"]]


@pytest.mark.parametrize("name", ALL_LISTS)
def test_every_value_an_export_emits_is_among_the_chosen_versions_choices(name):
    target, version = name.split("-", 1)
    t, exported = flag_table(name), 0
    for weights, kv in FORMATS:
        try:
            got = _emitted(target, version, weights, kv)
        except CannotExpress as e:  # the version has no such KV cache: refused, not a command it rejects
            # refused by the target's rule (knowledge/targets.yaml) or, for a version lacking it, by the export
            spelled = {"fp16": "float16", "fp32": "float32"}[kv] if kv in ("fp16", "fp32") else kv
            assert e.field == "layout.kv_cache_dtype" and kv in ("fp16", "fp32"), e
            assert f"no {kv} KV cache" in str(e) or f"no {spelled} KV cache" in str(e), e
            assert not t.allows("kv-cache-dtype", {"fp16": "float16", "fp32": "float32"}[kv] if target == "vllm" else kv)
            continue
        exported += 1
        for flag, value in got.items():
            assert value in t.flags[flag]["choices"], (name, weights, kv, flag, value)
        if weights in ("fp8", "awq", "gptq"):
            assert got["quantization"] == weights
        if kv == "fp8" or target == "vllm":
            assert "kv-cache-dtype" in got, (weights, kv)
    assert exported >= 12  # every weight format with the activation dtype and fp8 KV caches


def test_a_fp16_kv_cache_is_float16_where_vllm_has_it_and_refused_where_not():
    assert _emitted("vllm", "0.33.0", "none", "fp16") == {"kv-cache-dtype": "float16"}
    with pytest.raises(CannotExpress, match=r"vLLM 0\.11\.0 has no fp16 KV cache beside bf16 activations"):
        _emitted("vllm", "0.11.0", "none", "fp16")


# ----- (2) a wrong value is refused, naming the flag and the version ------------------------------


@pytest.mark.parametrize("name", ALL_LISTS)
@pytest.mark.parametrize("flag,wrong,right", [("quantization", "int3", "fp8"), ("kv-cache-dtype", "fp16", "auto")])
def test_a_value_outside_the_choices_is_refused_with_the_flag_and_version(name, flag, wrong, right):
    t = flag_table(name)
    t.check(flag, right)
    with pytest.raises(AssertionError) as e:
        t.check(flag, wrong)
    message = str(e.value)
    assert message.startswith(f"--{flag} {wrong!r} is not one of ") and f"{t.command} {t.version}" in message
    source = t.flags[flag].get("choices_source")
    assert (f"({source})" in message) if source else message.endswith(t.version)


# ----- (3) the ast reader, on source copied from the releases -----------------------------------

# vllm/model_executor/layers/quantization/__init__.py at v0.33.0 (lines 15-51)
QUANTIZATION_0_33 = '''
from typing import Literal, get_args

QuantizationMethods = Literal[
    "awq",
    "auto_awq",
    "fp8",
    "fbgemm_fp8",
    "fp_quant",
    "modelopt",
    "modelopt_fp4",
    "modelopt_mxfp8",
    "modelopt_mixed",
    "auto_gptq",
    "gptq",
    "gptq_marlin",
    "awq_marlin",
    "humming",
    "compressed-tensors",
    "experts_int8",
    "quark",
    "moe_wna16",
    "torchao",
    "inc",
    "mxfp4",
    "gpt_oss_mxfp4",
    "deepseek_v4_fp8",
    "online",
    # Below are online quant shorthand names (see vllm.config.quantization).
    # Listed here as strings to avoid a circular import; kept in sync with
    # _ONLINE_SHORTHANDS by the assertion in get_quantization_config().
    "fp8_per_tensor",
    "fp8_per_block",
    "fp8_per_channel",
    "int8_per_channel_weight_only",
    "nvfp4_per_token",
    "mxfp8",
]
QUANTIZATION_METHODS: list[str] = list(get_args(QuantizationMethods))

DEPRECATED_QUANTIZATION_METHODS = [
    "fbgemm_fp8",
    "fp_quant",
]
'''

# vllm/config/cache.py at v0.11.0 (lines 25-28)
CACHE_0_11 = '''
CacheDType = Literal["auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2",
                     "fp8_inc"]
MambaDType = Literal["auto", "float32"]
PrefixCachingHashAlgo = Literal["sha256", "sha256_cbor"]
'''

# python/sglang/srt/server_args.py at v0.5.3 (lines 69-87)
SGLANG_0_5_3 = '''
QUANTIZATION_CHOICES = [
    "awq",
    "fp8",
    "gptq",
    "marlin",
    "gptq_marlin",
    "awq_marlin",
    "bitsandbytes",
    "gguf",
    "modelopt",
    "modelopt_fp4",
    "petit_nvfp4",
    "w8a8_int8",
    "w8a8_fp8",
    "moe_wna16",
    "qoq",
    "w4afp8",
    "mxfp4",
]
'''


def test_the_ast_reader_returns_a_literal_alias_in_source_order():
    got = dump.choices_from_source(QUANTIZATION_0_33, "QuantizationMethods")
    assert len(got) == 30 and got[:3] == ["awq", "auto_awq", "fp8"] and got[-6:] == [
        "fp8_per_tensor", "fp8_per_block", "fp8_per_channel", "int8_per_channel_weight_only", "nvfp4_per_token", "mxfp8"]
    assert got == flag_table("vllm-0.33.0").flags["quantization"]["choices"]  # what the regenerated list holds
    assert dump.choices_from_source(CACHE_0_11, "CacheDType") == ["auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc"]
    assert dump.choices_from_source(CACHE_0_11, "MambaDType") == ["auto", "float32"]


def test_the_ast_reader_returns_a_list_of_strings_and_its_other_spellings():
    assert dump.choices_from_source(QUANTIZATION_0_33, "DEPRECATED_QUANTIZATION_METHODS") == ["fbgemm_fp8", "fp_quant"]
    got = dump.choices_from_source(SGLANG_0_5_3, "QUANTIZATION_CHOICES")
    assert got == flag_table("sglang-0.5.3").flags["quantization"]["choices"]  # argparse's, from the same constant
    src = 'from typing import TypeAlias\nA: TypeAlias = Literal["x", "y"]\nB = ("p",)\nC = typing.Literal["only"]\n'
    assert dump.choices_from_source(src, "A") == ["x", "y"]
    assert dump.choices_from_source(src, "B") == ["p"]
    assert dump.choices_from_source(src, "C") == ["only"]


@pytest.mark.parametrize("symbol,why", [
    ("QUANTIZATION_METHODS", "not a literal list of strings"),  # computed: list(get_args(...))
    ("NoSuchName", "not assigned at module level"),
])
def test_the_ast_reader_refuses_what_it_cannot_read_as_literals(symbol, why):
    with pytest.raises(LookupError, match=why):
        dump.choices_from_source(QUANTIZATION_0_33, symbol)


def test_source_choices_fill_only_flags_without_choices_and_read_back(tmp_path, monkeypatch):
    root = tmp_path / "src"
    (root / "vllm/model_executor/layers/quantization").mkdir(parents=True)
    (root / "vllm/config").mkdir(parents=True)
    (root / QUANTIZATION_FILE).write_text(QUANTIZATION_0_33)
    (root / "vllm/config/cache.py").write_text(CACHE_0_11)
    flags = dump.merge([dump.Flag("quantization", True), dump.Flag("kv-cache-dtype", True, ["auto", "fp8"]),
                        dump.Flag("dtype", True)])
    report = dump.add_source_choices(flags, "vllm", root)
    assert flags["quantization"].choices_source == f"{QUANTIZATION_FILE} QuantizationMethods"
    assert flags["kv-cache-dtype"].choices == ["auto", "fp8"] and flags["kv-cache-dtype"].choices_source is None
    assert flags["dtype"].choices is None and len(report) == 2
    text = dump.render("vllm", "9.9.9", flags, wheel="vllm-9.9.9-cp38-abi3-any.whl", sha256="0" * 64, mode="import",
                       date="2026-01-02", how="fixture")
    assert "# choices_source: the engine checks that flag's value after parsing" in text
    (tmp_path / "vllm-9.9.9.yaml").write_text(text)
    monkeypatch.setattr("shardplan.exporters.base.FLAGS_DIR", tmp_path)
    flag_table.cache_clear()
    try:
        t = flag_table("vllm-9.9.9")
        assert t.flags["quantization"]["choices_source"] == f"{QUANTIZATION_FILE} QuantizationMethods"
        with pytest.raises(AssertionError, match=r"--quantization 'int3' is not one of .* 9\.9\.9 \(vllm/model_executor"):
            t.check("quantization", "int3")
    finally:
        flag_table.cache_clear()


def test_a_release_without_the_source_file_gets_no_choices(tmp_path):
    flags = dump.merge([dump.Flag("quantization", True)])
    report = dump.add_source_choices(flags, "vllm", tmp_path)
    assert flags["quantization"].choices is None and report[0].startswith("warning: --quantization")
