"""`shardplan export --to llamacpp`: `llama-server` command lines checked by an argparse parser built
from the pinned flag list (flags/llamacpp-b11312.yaml); the layer, context and slot arithmetic
against llama.cpp's own rules; the plans llama.cpp cannot run refused through the CLI with one
line and exit 2; and the flag-list tool's pure parts on fixtures written here.

Plans come from `shardplan recommend ... -o plan.yaml` with a pinned layout (`--engine llamacpp`
among them). The CLI cannot yet plan GGUF formats or serving offload (`--quantization q4_k_m`
fails inside the cost model while that work is in progress, and there is no `--offload-layers`),
so those plans are the CLI's plan with fields changed by `model_copy(update=...)`, validated
again (`_edited`)."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from functools import lru_cache
from pathlib import Path

import pytest

from shardplan.exporters import TARGETS, CannotExpress, ExportOptions, export
from shardplan.exporters.base import argv, flag_table
from shardplan.exporters.llamacpp import PINNED_TAG
from shardplan.plan.manifest import load_manifest, write_manifest
from shardplan.plan.schema import DeploymentManifest

REPO = Path(__file__).parents[2]
TABLE = f"llamacpp-{PINNED_TAG}"


def _tool():
    spec = importlib.util.spec_from_file_location("dump_llamacpp_flags", REPO / "tools" / "dump_llamacpp_flags.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


dump = _tool()


# ----- plans ---------------------------------------------------------------------------------


def _plan(cli, tmp_path: Path, name: str, *args: str) -> Path:
    path = tmp_path / f"{name}.yaml"
    res = cli("recommend", *args, "-o", str(path), "--json")
    assert res.exit_code == 0, res.stderr
    return path


def _edited(path: Path, out: Path, *, layout: dict | None = None, workload: dict | None = None) -> Path:
    """The plan at `path` with layout/workload fields changed, validated again, written to `out`."""
    m = load_manifest(path)
    m = m.model_copy(update={"layout": m.layout.model_copy(update=layout or {}),
                             "workload": m.workload.model_copy(update=workload or {})})
    write_manifest(DeploymentManifest.model_validate(m.model_dump()), out)
    return out


ONE_GPU = ("llama-3.1-8b", "--hardware", "rtx-3090-24gb", "--gpus", "1", "--max-model-len", "8192")


@pytest.fixture
def one_gpu(cli, tmp_path):
    return _plan(cli, tmp_path, "one-gpu", *ONE_GPU)


def _serve(cli, plan: Path, *extra: str) -> str:
    r = cli("export", str(plan), "--to", "llamacpp", "-o", str(plan.parent / "out"), *extra)
    assert r.exit_code == 0, r.stderr
    return (plan.parent / "out" / "serve.sh").read_text()


# ----- the pinned flag list as a parser ------------------------------------------------------


@lru_cache(maxsize=None)
def pinned_parser() -> argparse.ArgumentParser:
    """llama-server's options as argparse takes them: every long option of the pinned list, its
    value count and choices; no positionals (llama.cpp has none) and no prefix matching (it takes
    whole names only)."""
    p = argparse.ArgumentParser(prog="llama-server", add_help=False, allow_abbrev=False, exit_on_error=False)
    for name, spec in flag_table(TABLE).flags.items():
        if not spec["takes_value"]:
            p.add_argument(f"--{name}", dest=name, action="store_true")
        else:
            p.add_argument(f"--{name}", dest=name, nargs=spec.get("num_values"), choices=spec.get("choices"))
    return p


def parse(words: list[str]) -> argparse.Namespace:
    try:
        ns, rest = pinned_parser().parse_known_args(words)
    except argparse.ArgumentError as e:
        raise SystemExit(str(e)) from None
    if rest:
        raise SystemExit(f"unrecognized arguments: {' '.join(rest)}")
    return ns


def commands(script: str) -> list[list[str]]:
    """argv after `llama-server` of each server the script starts."""
    out = []
    for line in script.replace("\\\n", " ").splitlines():
        if line.lstrip().startswith("#") or "llama-server" not in line:
            continue
        words = argv(line.rstrip(" &"))
        out.append(words[words.index("llama-server") + 1:])
    return out


def test_the_pinned_list_names_its_tag_commit_and_method():
    t = flag_table(TABLE)
    assert t.tool == "llamacpp" and t.version == PINNED_TAG and t.command == "llama-server"
    assert len(t.extra["commit"]) == 40 and t.extra["commit"] in t.sources[1]
    assert "llama-server --help" in t.extra["method"]
    # facts of b11312 the export relies on (common/arg.cpp at that commit)
    assert t.flags["flash-attn"]["choices"] == ["on", "off", "auto"]
    assert {"f16", "bf16", "f32", "q8_0"} <= set(t.flags["cache-type-k"]["choices"])
    assert t.flags["split-mode"]["choices"] == ["none", "layer", "row", "tensor"]
    assert t.flags["no-kv-unified"] == {**t.flags["no-kv-unified"], "takes_value": False, "negates": "kv-unified"}
    assert "-ngl" in t.flags["n-gpu-layers"]["aliases"] and t.flags["n-gpu-layers"]["env"] == "LLAMA_ARG_N_GPU_LAYERS"
    assert "mlock" not in t.flags and "load-mode" in t.flags  # b11312 folds --mlock/--no-mmap into --load-mode


def test_the_command_parses_with_the_pinned_flags_and_an_unknown_flag_does_not(cli, one_gpu):
    [words] = commands(_serve(cli, one_gpu))
    ns = parse(words)
    assert ns.model.endswith(".gguf") and ns.host == "0.0.0.0" and ns.port == "8000"
    assert getattr(ns, "flash-attn") == "on"
    with pytest.raises(SystemExit, match="unrecognized arguments: --gpu-memory-utilization"):
        parse([*words, "--gpu-memory-utilization", "0.9"])
    with pytest.raises(SystemExit, match="invalid choice"):
        parse([*words, "--split-mode", "pipeline"])
    with pytest.raises(SystemExit, match="unrecognized arguments: model.gguf"):
        parse([*words, "model.gguf"])  # no positional model argument
    with pytest.raises(SystemExit):
        parse(["--n-gpu"])  # no prefix matching


def test_every_flag_of_every_export_is_in_the_pinned_list(cli, tmp_path):
    """The golden plans of the other engines, through the same parser."""
    plans = [_plan(cli, tmp_path, "a", *ONE_GPU),
             _plan(cli, tmp_path, "b", "llama-3.1-70b", "--gpus", "8", "--tp", "4", "--dp", "2", "--max-model-len", "32768"),
             _plan(cli, tmp_path, "c", "llama-3.1-8b", "--gpus", "2", "--pp", "2", "--max-model-len", "8192"),
             _plan(cli, tmp_path, "d", "llama-3.1-70b", "--gpus", "16", "--gpus-per-node", "8", "--tp", "4", "--dp", "4",
                   "--max-model-len", "32768")]
    n = 0
    for p in plans:
        for words in commands(export(load_manifest(p), "llamacpp")[0].text):
            parse(words)
            n += 1
    assert n == 1 + 2 + 1 + 2  # servers: one, a replica per 4 GPUs of a node, one, two per node


# ----- what the command says -----------------------------------------------------------------


def gpu_decoder_layers(n_gpu_layers: int, num_layers: int) -> list[int]:
    """llama.cpp's rule (src/llama-model.cpp load_tensors): of n_layer decoder layers plus the output
    layer (index n_layer), those from i_gpu_start = max(n_layer + 1 - n_gpu_layers, 0) are on the GPU."""
    start = max(num_layers + 1 - n_gpu_layers, 0)
    return [i for i in range(num_layers) if i >= start]


@pytest.mark.parametrize("offload", [1, 7, 31, 32])
def test_n_gpu_layers_keeps_num_layers_minus_offload_layers_on_the_gpu(cli, one_gpu, offload):
    plan = _edited(one_gpu, one_gpu.parent / "off.yaml", layout={"offload_layers": offload, "offload_params": "cpu"})
    m = load_manifest(plan)
    [words] = commands(_serve(cli, plan))
    ngl = int(getattr(parse(words), "n-gpu-layers"))
    L = m.model.num_layers
    assert ngl == L + 1 - offload  # the output layer counts as one
    on_gpu = gpu_decoder_layers(ngl, L)
    assert len(on_gpu) == L - offload and on_gpu == list(range(offload, L))  # the first layers are offloaded
    assert "--threads" not in words  # the plan does not know the host's cores


def test_nothing_offloaded_puts_every_layer_and_the_output_on_the_gpu(cli, one_gpu):
    [words] = commands(_serve(cli, one_gpu))
    assert getattr(parse(words), "n-gpu-layers") == "all"  # -2 in b11312: n_layer + 1


def test_ctx_size_is_max_model_len_per_slot_and_slots_are_max_num_seqs(cli, tmp_path):
    plan = _plan(cli, tmp_path, "p", *ONE_GPU, "--max-num-seqs", "4")
    m = load_manifest(plan)
    ns = parse(commands(_serve(cli, plan))[0])
    assert int(ns.parallel) == m.workload.max_num_seqs == 4
    assert int(getattr(ns, "ctx-size")) == m.predicted.kv_cache.max_model_len_tokens * 4 == 8192 * 4
    assert getattr(ns, "no-kv-unified") and not getattr(ns, "kv-unified")  # one KV stream per slot
    assert int(getattr(ns, "ubatch-size")) == m.workload.max_num_batched_tokens


def test_a_plan_made_for_llama_cpp_exports_its_own_slots_and_batch(cli, tmp_path):
    plan = _plan(cli, tmp_path, "own", *ONE_GPU, "--engine", "llamacpp", "--max-num-seqs", "2")
    m = load_manifest(plan)
    assert m.workload.engine == "llamacpp"
    text = _serve(cli, plan)
    ns = parse(commands(text)[0])
    assert int(ns.parallel) == 2 and int(getattr(ns, "ctx-size")) == 2 * 8192
    assert int(getattr(ns, "ubatch-size")) == m.workload.max_num_batched_tokens
    head = [line for line in text.splitlines() if line.startswith("# ")]
    assert not any("warning" in line or "--engine-version" in line for line in head), head
    # The plan's rules are the pinned build's (b11312 is the newest llama.cpp shardplan knows): no version note.
    assert m.workload.engine_version == PINNED_TAG
    assert not any("memory rules; the flags are" in line for line in head), head


def test_slots_are_the_sequences_the_plans_kv_cache_holds_when_fewer(cli, one_gpu):
    m = load_manifest(one_gpu)
    kv = m.predicted.kv_cache
    held = kv.capacity_tokens // kv.max_model_len_tokens
    assert 1 <= held < m.workload.max_num_seqs  # vLLM's 256 is a cap, not an allocation
    text = _serve(cli, one_gpu)
    ns = parse(commands(text)[0])
    assert int(ns.parallel) == held and int(getattr(ns, "ctx-size")) == held * kv.max_model_len_tokens
    assert f"--parallel {held}, not max_num_seqs {m.workload.max_num_seqs}" in text


@pytest.mark.parametrize("quant,file_type", [("q4_k_m", "Q4_K_M"), ("iq4_xs", "IQ4_XS"), ("q8_0", "Q8_0"), ("none", "BF16")])
def test_the_model_is_a_gguf_file_of_the_plans_format(cli, one_gpu, quant, file_type):
    plan = _edited(one_gpu, one_gpu.parent / "q.yaml", layout={"weight_quantization": quant},
                   workload={"quantization": quant})
    r = cli("export", str(plan), "--to", "llamacpp", "-o", str(plan.parent / "q"))
    assert r.exit_code == 0, r.stderr
    words = commands((plan.parent / "q" / "serve.sh").read_text())[0]
    assert parse(words).model == f"/models/Llama-3.1-8B-{file_type}.gguf"
    readme = (plan.parent / "q" / "README.txt").read_text()
    assert ("llama-quantize Llama-3.1-8B-BF16.gguf Llama-3.1-8B-" + file_type in readme) == (quant != "none")
    assert "convert_hf_to_gguf.py" in readme


def test_every_llama_server_flag_the_readme_names_is_in_the_pinned_list(one_gpu):
    import re

    readme = export(load_manifest(one_gpu), "llamacpp")[1].text
    flags_part = readme.split("What the flags of serve.sh mean")[1].split("Getting the")[0]
    named = set(re.findall(r"(?<![\w-])--([a-z][a-z0-9-]*)", flags_part)) | {"hf-repo"}  # and the GGUF paragraph's
    assert {"n-gpu-layers", "ctx-size", "parallel", "no-kv-unified", "flash-attn", "ubatch-size", "cache-type-k"} <= named
    assert named <= set(flag_table(TABLE).flags), named - set(flag_table(TABLE).flags)


def test_model_path_must_be_a_gguf_file(cli, one_gpu):
    ok = cli("export", str(one_gpu), "--to", "llamacpp", "--model-path", "/data/m-Q4_K_M.gguf")
    assert ok.exit_code == 0 and "--model /data/m-Q4_K_M.gguf" in ok.stdout
    bad = cli("export", str(one_gpu), "--to", "llamacpp", "--model-path", "meta-llama/Llama-3.1-8B")
    assert bad.exit_code == 2 and "field '--model-path'" in bad.stderr and "not a GGUF file" in bad.stderr


def test_a_hostile_gguf_path_stays_one_word(one_gpu):
    hostile = "/models/x; touch PWNED $(touch PWNED) `id` 'q' \"dq\".gguf"
    text = export(load_manifest(one_gpu), "llamacpp", options=ExportOptions(model_path=hostile))[0].text
    assert parse(commands(text)[0]).model == hostile


def test_kv_cache_types_map_only_exact_formats(cli, one_gpu):
    words = commands(_serve(cli, one_gpu))[0]
    ns = parse(words)
    assert getattr(ns, "cache-type-k") == getattr(ns, "cache-type-v") == "bf16"
    fp16 = _edited(one_gpu, one_gpu.parent / "f16.yaml", layout={"kv_cache_dtype": "fp16"})
    assert getattr(parse(commands(_serve(cli, fp16))[0]), "cache-type-k") == "f16"


def test_pipeline_stages_split_layers_by_the_plans_stages(cli, tmp_path):
    plan = _plan(cli, tmp_path, "pp", "llama-3.1-8b", "--gpus", "2", "--pp", "2", "--max-model-len", "8192")
    m = load_manifest(plan)
    ns = parse(commands(_serve(cli, plan))[0])
    assert getattr(ns, "split-mode") == "layer"
    shares = [int(x) for x in getattr(ns, "tensor-split").split(",")]
    # llama.cpp puts layer il (the output layer is il = n_layer) on the first GPU whose cumulative
    # share exceeds il / (n_layer + 1) (load_tensors: upper_bound over the normalized splits)
    L = m.model.num_layers
    cum = [sum(shares[:i + 1]) / sum(shares) for i in range(len(shares))]
    gpu_of = [next(g for g, c in enumerate(cum) if c > il / (L + 1)) for il in range(L + 1)]
    for s in m.placement.stages:
        for a, b in s.layer_ranges:
            assert {gpu_of[il] for il in range(a, b + 1)} == {s.stage}
    assert gpu_of[L] == len(shares) - 1  # the output layer with the last stage


def test_tensor_parallel_replicas_split_rows_on_their_own_gpus_and_ports(cli, tmp_path):
    plan = _plan(cli, tmp_path, "tp", "llama-3.1-70b", "--gpus", "8", "--tp", "4", "--dp", "2", "--max-model-len", "32768")
    text = _serve(cli, plan)
    servers = [parse(w) for w in commands(text)]
    assert [getattr(s, "split-mode") for s in servers] == ["row", "row"]
    assert [getattr(s, "tensor-split") for s in servers] == ["1,1,1,1"] * 2
    assert [s.port for s in servers] == ["8000", "8001"]
    assert "CUDA_VISIBLE_DEVICES=0,1,2,3 llama-server" in text and "CUDA_VISIBLE_DEVICES=4,5,6,7 llama-server" in text


# ----- refusals ------------------------------------------------------------------------------


def _one_line_refusal(cli, plan: Path, field: str, words: str) -> None:
    r = cli("export", str(plan), "--to", "llamacpp")
    assert r.exit_code == 2 and r.stdout == "", r.stderr
    line = r.stderr.strip()
    assert "\n" not in line and line.startswith(f"error: {plan}: field '{field}': llamacpp cannot express this plan")
    assert words in line and "(fix: " in line


@pytest.mark.parametrize("quant", ["int8", "fp8", "int4", "awq", "gptq", "nf4"])
def test_non_gguf_weights_are_refused_with_the_fix(cli, one_gpu, quant):
    plan = _edited(one_gpu, one_gpu.parent / "w.yaml", layout={"weight_quantization": quant},
                   workload={"quantization": quant})
    _one_line_refusal(cli, plan, "layout.weight_quantization", f"{quant} weights are not a GGUF type")
    assert "re-plan with --quantization q4_k_m" in cli("export", str(plan), "--to", "llamacpp").stderr


@pytest.mark.parametrize("kv", ["fp8", "int8"])
def test_kv_cache_formats_llama_cpp_lacks_are_refused(cli, one_gpu, kv):
    plan = _edited(one_gpu, one_gpu.parent / "kv.yaml", layout={"kv_cache_dtype": kv})
    _one_line_refusal(cli, plan, "layout.kv_cache_dtype", f"llama.cpp has no {kv} KV cache")


def test_layouts_llama_cpp_cannot_run_are_refused(cli, tmp_path):
    both = _plan(cli, tmp_path, "tpp", "llama-3.1-70b", "--gpus", "8", "--tp", "4", "--pp", "2", "--max-model-len", "8192")
    _one_line_refusal(cli, both, "layout", "by layers (pp) or by rows (tp)")
    ep = _plan(cli, tmp_path, "ep", "mixtral-8x7b", "--gpus", "8", "--tp", "2", "--dp", "4", "--ep", "2",
               "--max-model-len", "32768")
    _one_line_refusal(cli, ep, "layout.ep", "no expert parallelism (ep=2)")
    span = _plan(cli, tmp_path, "span", "llama-3.1-405b", "--gpus", "16", "--gpus-per-node", "8", "--tp", "1",
                 "--pp", "16", "--max-model-len", "8192")
    _one_line_refusal(cli, span, "layout", "spans nodes")


def test_nvme_offload_and_training_plans_are_refused(cli, one_gpu, tmp_path):
    nvme = _edited(one_gpu, tmp_path / "nvme.yaml", layout={"offload_layers": 4, "offload_params": "nvme"})
    _one_line_refusal(cli, nvme, "layout.offload_params", "not at nvme")
    train = _plan(cli, tmp_path, "train", "llama-3.2-1b", "--workload", "training", "--gpus", "1", "--seq-len", "2048",
                  "--global-batch-size", "8")
    _one_line_refusal(cli, train, "workload.kind", "serves models and this is a training plan")


def test_the_target_is_registered_and_listed_in_export_help(cli):
    assert "llamacpp" in TARGETS
    r = cli("export", "--help")
    assert r.exit_code == 0 and "llamacpp" in r.stdout


def test_export_options_default_port_and_a_chosen_one(one_gpu):
    m = load_manifest(one_gpu)
    text = export(m, "llamacpp", options=ExportOptions(port=9100))[0].text
    assert parse(commands(text)[0]).port == "9100"
    with pytest.raises(CannotExpress):
        export(m.model_copy(update={"layout": m.layout.model_copy(update={"kv_cache_dtype": "fp8"})}), "llamacpp")


# ----- tools/dump_llamacpp_flags.py, pure parts on fixtures ----------------------------------

HELP = """----- common params -----

-h,    --help, --usage                  print usage and exit
-ngl,  --gpu-layers, --n-gpu-layers N   max. number of layers to store in VRAM, either an exact number,
                                        'auto', or 'all' (default: auto)
                                        (env: LLAMA_ARG_N_GPU_LAYERS)
-sm,   --split-mode {none,layer,row,tensor}
                                        how to split the model across multiple GPUs, one of:
                                        - none: use one GPU only
                                        (env: LLAMA_ARG_SPLIT_MODE)
-kvu,  --kv-unified, -no-kvu, --no-kv-unified
                                        use single unified KV buffer shared across all sequences
                                        (env: LLAMA_ARG_KV_UNIFIED)
-ctk,  --cache-type-k TYPE              KV cache data type for K
                                        allowed values: f32, f16, bf16, q8_0
                                        (default: f16)
-fa,   --flash-attn [on|off|auto]       set Flash Attention use ('on', 'off', or 'auto', default: 'auto')
-dt,   --defrag-thold N                 KV cache defragmentation threshold (DEPRECATED)
-ot,   --override-tensor <tensor name pattern>=<buffer type>,...
                                        override tensor buffer type
--host HOST                             ip address to listen (default: 127.0.0.1)
"""


def test_help_parsing_reads_spellings_hints_choices_env_and_negations():
    flags = dump.flag_entries(dump.parse_help(HELP))
    assert sorted(flags) == sorted(["help", "usage", "gpu-layers", "n-gpu-layers", "split-mode", "kv-unified",
                                    "no-kv-unified", "cache-type-k", "flash-attn", "defrag-thold", "override-tensor",
                                    "host"])
    assert flags["n-gpu-layers"] == {"takes_value": True, "metavar": "N", "aliases": ["-ngl", "--gpu-layers"],
                                     "env": "LLAMA_ARG_N_GPU_LAYERS"}
    assert flags["split-mode"]["choices"] == ["none", "layer", "row", "tensor"]
    assert flags["kv-unified"]["takes_value"] is False and flags["kv-unified"]["aliases"] == ["-kvu"]
    assert flags["no-kv-unified"]["negates"] == "kv-unified" and flags["no-kv-unified"]["aliases"] == ["-no-kvu"]
    assert flags["cache-type-k"]["choices"] == ["f32", "f16", "bf16", "q8_0"]
    assert flags["flash-attn"]["choices"] == ["on", "off", "auto"]
    assert flags["override-tensor"]["metavar"] == "<tensor name pattern>=<buffer type>,..."
    assert "choices" not in flags["override-tensor"]
    assert flags["defrag-thold"]["deprecated"] and "DEPRECATED" in flags["defrag-thold"]["note"]
    assert flags["host"] == {"takes_value": True, "metavar": "HOST"}


ARG_CPP = r'''
static std::initializer_list<enum llama_example> mmproj_examples = {
    LLAMA_EXAMPLE_MTMD,
    LLAMA_EXAMPLE_SERVER,
};
common_params_context common_params_parser_init(common_params & params, llama_example ex, void(*print_usage)(int, char **)) {
    add_opt(common_arg(
        {"-c", "--ctx-size"}, "N",
        string_format("size of the prompt context (default: %d, 0 = loaded from model)", params.n_ctx),
        [](common_params & params, int value) { params.n_ctx = value; }
    ).set_env("LLAMA_ARG_CTX_SIZE"));
    add_opt(common_arg(
        {"-kvu", "--kv-unified"},
        {"-no-kvu", "--no-kv-unified"},
        "use single unified KV buffer (default: \"auto\")",
        [](common_params & params, bool value) { params.kv_unified = value; }
    ).set_env("LLAMA_ARG_KV_UNIFIED").set_examples({LLAMA_EXAMPLE_SERVER, LLAMA_EXAMPLE_PERPLEXITY}));
    add_opt(common_arg(
        {"--perplexity-only"},
        "compute perplexity (a switch, with {braces} and (parens) in its help)",
        [](common_params & params) { if (true) { params.ppl = 1; } }
    ).set_examples({LLAMA_EXAMPLE_PERPLEXITY}));
    add_opt(common_arg(
        {"--mmproj-url"}, "URL", "a projector",
        [](common_params & params, const std::string & value) { params.mmproj.url = value; }
    ).set_examples(mmproj_examples));
    add_opt(common_arg(
        {"--not-for-server"}, "N", "everything but the server",
        [](common_params & params, int value) { params.x = value; }
    ).set_excludes({LLAMA_EXAMPLE_SERVER}));
    add_opt(common_arg(
        {"--control-vector-layer-range"}, "START", "END",
        "layer range", // a comment with a ) in it
        [](common_params & params, const std::string & start, const std::string & end) { }
    ));
}
'''


def test_source_parsing_follows_the_in_example_rule_and_the_constructors():
    opts = dump.parse_arg_cpp(ARG_CPP)
    server = {n for o in opts if o.in_tool("LLAMA_EXAMPLE_SERVER") for n in o.long_names}
    # no set_examples: COMMON, so in the server; SERVER-tagged; a named list that holds SERVER;
    # not a PERPLEXITY-only option; not one excluded from the server
    assert server == {"--ctx-size", "--kv-unified", "--no-kv-unified", "--mmproj-url", "--control-vector-layer-range"}
    flags = dump.flag_entries([o for o in opts if o.in_tool("LLAMA_EXAMPLE_SERVER")])
    assert flags["ctx-size"] == {"takes_value": True, "metavar": "N", "aliases": ["-c"], "env": "LLAMA_ARG_CTX_SIZE"}
    assert flags["no-kv-unified"]["takes_value"] is False and flags["no-kv-unified"]["negates"] == "kv-unified"
    assert flags["control-vector-layer-range"]["num_values"] == 2
    perplexity = next(o for o in opts if "--perplexity-only" in o.names)
    assert perplexity.num_values == 0 and perplexity.examples == {"LLAMA_EXAMPLE_PERPLEXITY"}


def test_help_and_source_disagreements_are_reported():
    help_opts = dump.parse_help("--ctx-size N                            ctx\n--extra                                 x\n")
    src = [o for o in dump.parse_arg_cpp(ARG_CPP) if o.in_tool("LLAMA_EXAMPLE_SERVER")]
    problems = dump.compare(help_opts, src)
    assert "--extra: only in --help" in problems and "--kv-unified: only in the source" in problems
    assert not any(p.startswith("--ctx-size") for p in problems)


def test_n_cpu_moe_is_exported_beside_n_gpu_layers(cli, tmp_path):
    """The plan's offload_expert_layers -> --n-cpu-moe N (common/arg.cpp: the routed experts of layers
    0..N-1 to the CPU buffer type), a flag of the pinned list; a plan without it has no such flag."""
    base = _plan(cli, tmp_path, "moe", "qwen3-30b-a3b", "--hardware", "h100-sxm-80gb", "--gpus", "1",
                 "--max-model-len", "4096", "--engine", "llamacpp")
    [plain] = commands(_serve(cli, base))
    assert getattr(parse(plain), "n-cpu-moe") is None
    plan = _edited(base, tmp_path / "experts.yaml", layout={"offload_expert_layers": 12})
    assert load_manifest(plan).layout.offload_expert_layers == 12  # read back as written
    [words] = commands(_serve(cli, plan))
    ns = parse(words)
    assert getattr(ns, "n-cpu-moe") == "12"
    assert getattr(ns, "n-gpu-layers") == "all"  # every layer's attention stays on the GPU
    readme = (plan.parent / "out" / "README.txt").read_text()
    assert "--n-cpu-moe 12" in readme


def test_routed_experts_in_host_memory_run_only_on_llama_cpp(cli, tmp_path):
    """No other serving target places experts in host memory: their exporters refuse such a plan
    with the shared rule (knowledge/targets.yaml host_experts), and runs_on names llama.cpp alone."""
    from shardplan.exporters.targets import first_refusal
    from shardplan.knowledge.load import targets_file
    from shardplan.specs.loading import load_model

    base = _plan(cli, tmp_path, "moe2", "qwen3-30b-a3b", "--hardware", "h100-sxm-80gb", "--gpus", "1",
                 "--max-model-len", "4096", "--engine", "llamacpp")
    m = load_manifest(_edited(base, tmp_path / "experts2.yaml", layout={"offload_expert_layers": 12}))
    spec = load_model("qwen3-30b-a3b").spec
    f = targets_file()
    for target in ("vllm", "sglang", "tgi", "trtllm", "accelerate", "jax"):
        found = first_refusal(m, spec, f.rules_of(target))
        assert found is not None and found[0].id == "routed experts in host memory", target
    assert first_refusal(m, spec, f.rules_of("llamacpp")) is None
