"""A corpus of broken and hostile inputs, one per case, for every file shardplan reads (HF
config.json, model YAML, hardware profile, manifest) and for command-line values.

Each must give exit 2 and one line on stderr naming the file (and the field where there is one),
no traceback, no hang, and no output file left behind. The corpus is generated here, so each
case shows what it breaks; `test_corpus_size` keeps it from shrinking unnoticed.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from conftest import REPO, build_plan

from shardplan.cost.layout import Layout
from shardplan.cost.workload import InferenceWorkload

LLAMA = {"model_type": "llama", "hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 2,
         "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 1000, "max_position_embeddings": 256}
ARCH = ("name: m\narchitecture:\n  vocab_size: 1000\n  hidden_size: 512\n  num_layers: 2\n  num_attention_heads: 8\n"
        "  num_kv_heads: 4\n  intermediate_size: 1024\n  max_position_embeddings: 256\n")
HARDWARE = (REPO / "hardware_profiles" / "h100-sxm-80gb.yaml").read_text()


@dataclass(frozen=True)
class Case:
    id: str
    kind: str  # hf | model | hardware | manifest
    name: str  # file name
    data: bytes
    needles: tuple[str, ...]  # in the error line besides the file name
    field: str | None = None  # the field the line must name


def _json(d) -> bytes:
    return json.dumps(d).encode()


def hf(id_, needles, field=None, data=None, **patch) -> Case:
    body = data if data is not None else _json({**LLAMA, **patch})
    return Case(id_, "hf", "config.json", body, tuple(needles), field)


def arch(id_, needles, field=None, *, replace=None, append="", text=None) -> Case:
    t = text if text is not None else ARCH
    if replace:
        assert replace[0] in t, replace
        t = t.replace(*replace)
    return Case(id_, "model", "m.yaml", (t + append).encode(), tuple(needles), field)


def hw(id_, needles, field=None, *, replace=None, text=None) -> Case:
    t = text if text is not None else HARDWARE
    if replace:
        assert replace[0] in t, replace
        t = t.replace(*replace, 1)
    return Case(id_, "hardware", "hw.yaml", t.encode(), tuple(needles), field)


def bomb(levels: int, width: int, where: str = "architecture:\n  vocab_size: *l{last}\n") -> str:
    lines = ["name: m", "x-anchors:", "  l0: &l0 [1, 2, 3]"]
    lines += [f"  l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * width)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n" + where.format(last=levels - 1)


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


HF_CASES = [
    hf("truncated", ["invalid JSON"], data=_json(LLAMA)[:60]),
    hf("empty", ["invalid JSON"], data=b""),
    hf("top-level-list", ["expected a mapping"], data=b"[1, 2]"),
    hf("string-for-int", ["valid integer"], "hidden_size", hidden_size="wide"),
    hf("fraction-for-int", ["fractional part"], "hidden_size", hidden_size=1.5),
    hf("bool-for-int", ["not true/false"], "hidden_size", hidden_size=True),
    hf("nan", ["the JSON holds NaN, which is not a number JSON allows"], data=_json(LLAMA).replace(b"256", b"NaN")),
    hf("infinity", ["holds Infinity, which is not a number"], data=_json(LLAMA).replace(b"256", b"Infinity")),
    hf("minus-infinity", ["holds -Infinity, which is not a number"], data=_json(LLAMA).replace(b"256", b"-Infinity")),
    hf("float-overflow-to-inf", ["finite number"], "max_position_embeddings",
       data=_json(LLAMA).replace(b"256", b"1e400")),
    hf("negative", ["greater than 0"], "vocab_size", vocab_size=-5),
    hf("zero-heads", ["greater than 0"], "num_attention_heads", num_attention_heads=0),
    hf("huge-width", ["less than or equal to 1048576"], "hidden_size", hidden_size=10**30),
    hf("huge-layers", ["less than or equal to 1024"], "num_hidden_layers", num_hidden_layers=10**9),
    hf("huge-vocab-bigint", ["less than or equal to 16777216"], "vocab_size", vocab_size=10**400),
    hf("huge-context", ["less than or equal to 1073741824"], "max_position_embeddings", max_position_embeddings=2**62),
    hf("duplicate-key", ["the JSON holds the key 'model_type' twice in one object"],
       data=b'{"model_type": "llama", "model_type": "mamba", "hidden_size": 8}'),
    hf("not-utf8", ["not UTF-8"], data=b'{"model_type": "\xff\xfe"}'),
    hf("utf16", ["not UTF-8"], data=json.dumps(LLAMA).encode("utf-16")),
    hf("nested-100", ["nested more than 64 levels"], data=b'{"a": ' + nested(100).encode() + b"}"),
    hf("nested-100000", ["JSON nested too deeply"], data=nested(100_000).encode()),
    hf("unknown-model-type", ["unsupported model_type 'mamba'"], "model_type", model_type="mamba"),
    hf("model-type-list", ["unsupported model_type"], "model_type", model_type=["llama"], architectures="x"),
    hf("missing-key", ["required key is missing"], "hidden_size", data=_json({k: v for k, v in LLAMA.items() if k != "hidden_size"})),
    hf("heads-not-dividing", ["not divisible", "set head_dim"], hidden_size=500),
    hf("kv-heads-not-dividing", ["a positive divisor of num_attention_heads"], num_key_value_heads=3),
    hf("topk-over-experts", ["exceeds num_experts"], model_type="mixtral", num_local_experts=4, num_experts_per_tok=8),
    hf("wrong-type-act", ["valid string"], "hidden_act", hidden_act={"a": 1}),
]

MODEL_CASES = [
    arch("unclosed-flow", ["invalid YAML", "line"], text="name: m\narchitecture: [unclosed\n"),
    arch("tab-indent", ["invalid YAML", "line"], text="name: m\narchitecture:\n\tvocab_size: 1\n"),
    arch("truncated", ["invalid YAML"], text=ARCH[: ARCH.index("vocab_size")] + "  vocab_size: [1, 2\n"),
    arch("duplicate-key", ["duplicate key 'hidden_size'"], append="  hidden_size: 1024\n"),
    arch("alias-bomb", ["more than 1000000 values", "YAML aliases counted"], text=bomb(21, 3)),
    arch("too-many-aliases", ["more than 64 YAML aliases"], text=bomb(3, 40)),
    arch("recursive-alias", ["nested more than 64 levels"], text="name: m\narchitecture: &a\n  vocab_size: [*a]\n"),
    arch("python-tag", ["could not determine a constructor", "python/object/apply"],
         text='name: m\narchitecture: !!python/object/apply:os.system ["touch PWNED"]\n'),
    arch("python-name-tag", ["could not determine a constructor"], text="name: !!python/name:os.system\n"),
    arch("misspelt-key", ["unknown key", "did you mean 'hidden_size'"], "architecture.hiden_size",
         replace=("hidden_size", "hiden_size")),
    arch("misspelt-section", ["unknown key", "did you mean 'architecture'"], "architecure",
         text=ARCH.replace("architecture:", "architecture: {}\narchitecure:")),
    arch("both-sections", ["exactly one of 'hf_config' and 'architecture'"], append="hf_config: {}\n"),
    arch("name-inside", ["set at the top level"], "architecture.name", append="  name: inner\n"),
    arch("nan", ["finite number"], "architecture.hidden_size", replace=("hidden_size: 512", "hidden_size: .nan")),
    arch("inf", ["finite number"], "architecture.vocab_size", replace=("vocab_size: 1000", "vocab_size: .inf")),
    arch("negative-layers", ["greater than 0"], "architecture.num_layers", replace=("num_layers: 2", "num_layers: -2")),
    arch("100k-layers", ["less than or equal to 1024"], "architecture.num_layers",
         replace=("num_layers: 2", "num_layers: 100000")),
    arch("bool-layers", ["not true/false"], "architecture.num_layers", replace=("num_layers: 2", "num_layers: yes")),
    arch("string-width", ["valid integer"], "architecture.hidden_size", replace=("hidden_size: 512", "hidden_size: big")),
    arch("int-key", ["Keys should be strings"], text="1: 2\n" + ARCH),
    arch("int-key-inside", ["valid string"], append="  7: 8\n"),
    arch("complex-key", ["mapping key must be a plain value"], append="  ? [a, b]\n  : 1\n"),
    arch("empty", ["expected a mapping", "NoneType"], text=""),
    arch("scalar", ["expected a mapping", "int"], text="42\n"),
    arch("nested-70", ["nested more than 64 levels"], append=f"  hidden_act: {nested(70)}\n"),
    arch("nested-2000", ["YAML nested too deeply", "check that this is the file meant"],
         append=f"  hidden_act: {nested(2000)}\n"),
    Case("latin1", "model", "m.yaml", b"name: caf\xe9\n", ("not UTF-8",)),
    arch("dense-index-out-of-range", ["dense_layer_indices [9]"], "architecture",
         append="  moe: {num_experts: 4, num_experts_per_token: 2, expert_intermediate_size: 64, dense_layer_indices: [9]}\n"),
    arch("topk-over-experts", ["exceeds num_experts"], "architecture.moe",
         append="  moe: {num_experts: 4, num_experts_per_token: 8, expert_intermediate_size: 64}\n"),
    arch("global-without-window", ["sliding_window is not"], "architecture", append="  global_layer_every: 2\n"),
    arch("sources-list", ["sources"], "sources", append="sources: [1, 2]\n"),
    arch("published-negative", ["greater than 0"], "published_num_params", append="published_num_params: -1\n"),
]

HW_CASES = [
    hw("misspelt-key", ["unknown key", "memory_capacity_gib"], "gpu.memory_capacity_gb",
       replace=("memory_capacity_gib:", "memory_capacity_gb:")),
    hw("zero-gpus", ["greater than 0"], "node.gpus_per_node", replace=("gpus_per_node: 8", "gpus_per_node: 0")),
    hw("huge-gpus", ["less than or equal to 65536"], "node.gpus_per_node",
       replace=("gpus_per_node: 8", "gpus_per_node: 1000000000")),
    hw("bool-gpus", ["not true/false"], "node.gpus_per_node", replace=("gpus_per_node: 8", "gpus_per_node: true")),
    hw("nan-memory", ["finite number"], "gpu.memory_capacity_gib", replace=("memory_capacity_gib: 79.11", "memory_capacity_gib: .nan")),
    hw("huge-memory", ["less than or equal to"], "gpu.memory_capacity_gib",
       replace=("memory_capacity_gib: 79.11", "memory_capacity_gib: 1e308")),
    hw("huge-tflops", ["less than or equal to"], "gpu.peak_dense_tflops.fp16", replace=("fp16: 989.4", "fp16: 1e300")),
    hw("efficiency-over-one", ["less than or equal to 1"], "efficiency.matmul", replace=("matmul: 0.8", "matmul: 1.5")),
    hw("unknown-link", ["Input should be"], "node.intra_node_link.kind", replace=("kind: nvswitch", "kind: carrier-pigeon")),
    hw("negative-latency", ["greater than or equal to 0"], "node.inter_node_link.latency_us",
       replace=("latency_us: 5.0", "latency_us: -5.0")),
    hw("string-tflops", ["valid number"], "gpu.peak_dense_tflops.fp16", replace=("fp16: 989.4", "fp16: fast")),
    hw("missing-section", ["required key is missing"], "runtime", text=HARDWARE[: HARDWARE.index("runtime:")]),
    hw("duplicate-key", ["duplicate key 'gpus_per_node'"], replace=("gpus_per_node: 8", "gpus_per_node: 8\n  gpus_per_node: 4")),
    hw("truncated", ["invalid YAML"], text=HARDWARE[: HARDWARE.index("peak_dense_tflops")] + "  peak_dense_tflops: {fp32: 1\n"),
    hw("alias-bomb", ["more than 1000000 values"], text=bomb(21, 3, where="").replace("name: m", "name: h")),
    hw("top-level-list", ["expected a mapping"], text="- gpu\n- node\n"),
]


# ----- manifests: a real plan, then edited -------------------------------------------------


def _plan_data() -> dict:
    m, _ = build_plan("llama-3.1-8b", 8, Layout(tp=2, dp=4), InferenceWorkload(max_model_len=8192))
    return m.model_dump(mode="json")


def _edit(data: dict, dotted: str, value) -> dict:
    out = json.loads(json.dumps(data))
    *path, last = dotted.split(".")
    node = out
    for p in path:
        node = node[int(p)] if isinstance(node, list) else node[p]
    if value is _DELETE:
        del node[last]
    else:
        node[last] = value
    return out


_DELETE = object()
MANIFEST_EDITS = [  # id, edits, needles, field
    ("future-schema", [("schema_version", 99)], ["newer shardplan", "schema 99"], "schema_version"),
    ("schema-as-string", [("schema_version", "1")], ["valid integer"], "schema_version"),
    ("schema-zero", [("schema_version", 0)], ["greater than or equal to 1"], "schema_version"),
    ("missing-layout", [("layout", _DELETE)], ["required key is missing"], "layout"),
    ("misspelt-layout-key", [("layout.tpp", 2)], ["unknown key", "did you mean 'tp'"], "layout.tpp"),
    ("tp-not-dividing-heads", [("model.num_attention_heads", 31)], ["tp=2 does not divide the 31 attention heads"], "layout.tp"),
    ("degrees-not-gpus", [("layout.dp", 3)], ["is not the 8 GPUs"], "layout"),
    ("ep-on-dense", [("layout.ep", 2)], ["needs a mixture-of-experts model"], "layout.ep"),
    ("huge-degree", [("layout.tp", 10**30)], ["is not the 8 GPUs"], "layout"),
    ("bool-degree", [("layout.tp", True)], ["valid integer"], "layout.tp"),
    ("negative-degree", [("layout.pp", -1)], ["greater than or equal to 1"], "layout.pp"),
    ("stage-out-of-order", [("placement.stages.0.first_rank", 5)], ["do not follow from the layout"], "placement.stages.0"),
    ("bad-sha", [("model.spec_sha256", "zz")], ["should match pattern"], "model.spec_sha256"),
    ("nan-figure", [("predicted.memory.headroom_bytes", float("nan"))], ["finite number"], "predicted.memory.headroom_bytes"),
    ("wrong-workload-kind", [("workload.kind", "mining")], ["workload"], None),
]


def _manifest_cases() -> list[Case]:
    base = _plan_data()
    text = yaml.safe_dump(base, sort_keys=False)
    cases = []
    for id_, edits, needles, field in MANIFEST_EDITS:
        d = base
        for dotted, value in edits:
            d = _edit(d, dotted, value)
        cases.append(Case(id_, "manifest", "plan.yaml", yaml.safe_dump(d, sort_keys=False).encode(), tuple(needles), field))
    cases += [
        # cut mid-file: still YAML, but what follows the cut is missing
        # cut before the last top-level key that starts in the first half: valid YAML that lacks the later keys
        Case("truncated", "manifest", "plan.yaml",
             text[: max(m.start() for m in re.finditer(r"\n(?=[a-z])", text[: len(text) // 2])) + 1].encode(),
             ("required key is missing",)),
        # cut inside a quoted scalar (a line start, then an unclosed quote): not YAML at all
        Case("truncated-mid-token", "manifest", "plan.yaml",
             (text[: text.rindex("\n", 0, len(text) // 2) + 1] + 'x: "unclosed').encode(), ("invalid YAML",)),
        Case("duplicate-key", "manifest", "plan.yaml", (text + "objective: latency\n").encode(), ("duplicate key 'objective'",)),
        Case("alias-bomb", "manifest", "plan.yaml", (bomb(21, 3, where="") + text).encode(), ("more than 1000000 values",)),
        Case("top-level-list", "manifest", "plan.yaml", b"- 1\n", ("expected a mapping",)),
        Case("not-utf8", "manifest", "plan.yaml", b"schema_version: 1\nname: \xff\n", ("not UTF-8",)),
    ]
    return cases


FILE_CASES = HF_CASES + MODEL_CASES + HW_CASES


def _assert_one_line(res, path: Path | None, needles, field=None):
    assert res.exit_code == 2, (res.exit_code, res.stderr)
    assert "Traceback" not in res.stderr and res.stdout == ""
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, res.stderr
    line = lines[0]
    assert line.startswith("error: "), line
    if path is not None:
        assert str(path) in line, line
    for n in needles:
        assert n in line, (n, line)
    if field is not None:
        assert f"field '{field}'" in line, (field, line)


@pytest.mark.parametrize("case", FILE_CASES, ids=lambda c: f"{c.kind}-{c.id}")
def test_bad_input_file_is_one_line_exit_2(cli, tmp_path, case):
    path = tmp_path / case.name
    path.write_bytes(case.data)
    cmd = ["hardware", "show", str(path)] if case.kind == "hardware" else ["models", "show", str(path)]
    _assert_one_line(cli(*cmd), path, case.needles, case.field)
    assert not (tmp_path / "PWNED").exists() and not Path("PWNED").exists()


@pytest.mark.parametrize("case", [c for c in FILE_CASES if c.kind != "hardware"][::4], ids=lambda c: f"{c.kind}-{c.id}")
def test_recommend_with_a_bad_model_writes_no_plan(cli, tmp_path, case):
    path = tmp_path / case.name
    path.write_bytes(case.data)
    out = tmp_path / "out" / "plan.yaml"
    _assert_one_line(cli("recommend", str(path), "--gpus", "1", "-o", str(out), "--export", "vllm"), path, case.needles)
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def manifest_cases():
    return _manifest_cases()


def test_manifest_corpus(cli, tmp_path, manifest_cases):
    for case in manifest_cases:
        path = tmp_path / f"{case.id}.yaml"
        path.write_bytes(case.data)
        _assert_one_line(cli("show", str(path)), path, case.needles, case.field)
        out = tmp_path / f"out-{case.id}"
        _assert_one_line(cli("export", str(path), "--to", "vllm", "-o", str(out)), path, case.needles, case.field)
        assert not out.exists(), case.id  # nothing written, not even the folder


def test_a_stale_spec_hash_is_refused_on_export(cli, tmp_path):
    data = _plan_data()
    spec = tmp_path / "m.yaml"
    spec.write_text(ARCH)
    from shardplan.plan.manifest import spec_sha256
    from shardplan.specs.loading import load_model

    data = _edit(data, "model.source", str(spec))
    data = _edit(data, "model.spec_sha256", spec_sha256(load_model(str(spec)).spec))
    fresh = tmp_path / "fresh.yaml"
    fresh.write_text(yaml.safe_dump(data, sort_keys=False))
    assert cli("export", str(fresh), "--to", "vllm").exit_code == 0
    spec.write_text(ARCH.replace("num_layers: 2", "num_layers: 4"))  # the spec changed after planning
    _assert_one_line(cli("export", str(fresh), "--to", "vllm", "-o", str(tmp_path / "out")), fresh,
                     ["has changed since this plan was made"], "model.spec_sha256")
    assert not (tmp_path / "out").exists()


def test_a_plan_source_is_read_only_as_a_model_spec(cli, tmp_path, monkeypatch):
    """A hostile plan naming a device, a pipe or a path dressed as a bundled name: export neither
    hangs nor reads it, and still exports (the spec is simply unavailable)."""
    from shardplan.plan import readback
    from shardplan.plan.manifest import load_manifest
    from shardplan.specs import loading

    fifo = tmp_path / "pipe.yaml"
    os.mkfifo(fifo)
    read: list[str] = []
    real = loading.load_model
    monkeypatch.setattr(loading, "load_model", lambda s: (read.append(s), real(s))[1])
    for source in ("/dev/zero", "/dev/stdin", str(fifo), "bundled:../../etc/passwd", "bundled:/etc/passwd"):
        p = tmp_path / "plan.yaml"
        p.write_text(yaml.safe_dump(_edit(_plan_data(), "model.source", source), sort_keys=False))
        assert readback.source_spec(load_manifest(p)) is None
        res = cli("export", str(p), "--to", "vllm")
        assert res.exit_code == 0 and "vllm serve" in res.stdout, res.stderr
    assert not any("passwd" in s for s in read), read  # a bundled: name is looked up in the catalog only


@pytest.mark.parametrize("path,words", [("/dev/zero", "not a regular file"), ("/dev/null", "not a regular file")])
def test_device_files_are_refused_not_read(cli, path, words):
    _assert_one_line(cli("models", "show", path), Path(path), [words])


def test_a_fifo_and_an_oversized_file_are_refused(cli, tmp_path):
    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)
    _assert_one_line(cli("models", "show", str(fifo)), fifo, ["not a regular file"])
    big = tmp_path / "big.json"
    with big.open("wb") as f:
        f.truncate(16 * 1024 * 1024 + 1)
    _assert_one_line(cli("models", "show", str(big)), big, ["byte limit"])


# ----- command-line values -----------------------------------------------------------------

CLI_CASES = [  # args, needles, field (None: typer's own range check, exit 2 without our line)
    (["estimate", "llama-3.1-8b", "--gpus", "100000000"], ["more than the 16777216"], "--gpus"),
    (["recommend", "llama-3.1-8b", "--max-gpus", "100000000"], ["more than the 16777216"], "--max-gpus"),
    (["estimate", "llama-3.1-8b", "--gpus-per-node", "100000000"], ["more than"], "--gpus-per-node"),
    (["estimate", "llama-3.1-8b", "--nodes", "100000000"], ["more than"], "--nodes"),
    (["estimate", "llama-3.1-8b", "--input-len", str(2**40)], ["more than the 1073741824"], "--input-len"),
    (["estimate", "llama-3.1-8b", "--max-model-len", str(10**30)], ["more than"], "--max-model-len"),
    (["estimate", "llama-3.1-8b", "--workload", "training", "--seq-len", str(2**31)], ["more than"], "--seq-len"),
    (["recommend", "llama-3.1-8b", "--max-num-seqs", str(2**30)], ["more than"], "--max-num-seqs"),
    (["estimate", "llama-3.1-8b", "--gpu-memory-utilization", "nan"], ["must be in (0, 1]"], "--gpu-memory-utilization"),
    (["estimate", "llama-3.1-8b", "--gpu-memory-utilization", "1.5"], ["must be in (0, 1]"], "--gpu-memory-utilization"),
    (["recommend", "llama-3.1-8b", "--objective", "cost", "--gpu-hour-price", "inf"], ["finite number"], "--gpu-hour-price"),
    (["recommend", "llama-3.1-8b", "--min-throughput", "inf"], ["finite number"], "--min-throughput"),
    (["estimate", "llama-3.1-8b", "--kv-cache-dtype", "fp9"], ["unknown dtype 'fp9'"], "--kv-cache-dtype"),
    (["recommend", "llama-3.1-8b", "--allow-quantization", "fp9"], ["unknown format 'fp9'"], "--allow-quantization"),
    (["recommend", "llama-3.1-8b", "--compare", "tp=x"], ["bad value"], "--compare"),
    (["recommend", "llama-3.1-8b", "--compare", "rm -rf ~"], ["cannot read"], "--compare"),
    (["estimate", "llama-3.1-8b", "--gpus", "12"], ["not 2 whole node(s) of 8"], "--gpus"),
    (["estimate", "llama-3.1-8b", "--gpus", "8", "--tp", "3"], ["does not divide the 8 GPUs"], "--tp/--pp/--cp"),
    (["estimate", "llama-3.1-8b", "--hardware", "h100-sxm"], ["unknown hardware", "h100-sxm-80gb"], None),
    (["estimate", "llama-3.1-8b; rm -rf ~"], ["unknown model"], None),
    (["estimate", "llama-3.1-8b", "--max-ttft-ms", "nan"], [], None),
    (["recommend", "llama-3.1-8b", "--max-ttft-ms", "nan"], [], None),
    (["estimate", "llama-3.1-8b", "--gpus", "0"], [], None),
    (["estimate", "llama-3.1-8b", "--gpus", "99999999999999999999999999999"], ["more than"], "--gpus"),
]


@pytest.mark.parametrize("args,needles,field", CLI_CASES, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_bad_command_line_value_is_exit_2(cli, args, needles, field):
    res = cli(*args)
    if not needles:  # typer/click rejects it before shardplan runs: exit 2, its usage box, no traceback
        assert res.exit_code == 2 and "Traceback" not in res.stderr and res.stdout == "", res.stderr
        return
    _assert_one_line(res, None, needles, field)


def test_corpus_size():
    assert len(FILE_CASES) >= 70 and len(MANIFEST_EDITS) >= 15 and len(CLI_CASES) >= 20
