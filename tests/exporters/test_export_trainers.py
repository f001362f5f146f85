"""Trainer exports for 3D plans (issue 26, item 3): Megatron-LM's pretrain_gpt.py flags, checked
against the flag list dumped from Megatron's own parser at the pinned tag; torchtitan's job TOML,
parsed with tomllib and its keys checked against torchtitan 0.2.2's JobConfig fields (and, under
`consumers`, loaded by torchtitan's own ConfigManager); refusals; the degrees --script receives."""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest
from test_export import any_plan, files, run

from shardplan.exporters import CannotExpress, export
from shardplan.exporters.base import argv, flag_table
from shardplan.exporters.megatron import FLAGS
from shardplan.exporters.torchtitan import KEYS

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

MEGATRON_PLANS = ["train-1gpu", "train-3d-1node", "train-2node"]
TORCHTITAN_PLANS = ["train-1gpu-h200", "train-3d-1node-fsdp", "train-2node"]


def megatron_argv(name: str, **opts) -> list[str]:
    """The words after pretrain_gpt.py (or --script's words) on the torchrun line."""
    text = files("megatron", name, **opts)["pretrain.sh"]
    words = argv(text[text.index("torchrun \\"):])
    start = next(i for i, w in enumerate(words) if w.endswith("pretrain_gpt.py") or w == "train.py")
    return words[start + 1:]


def flags_of(words: list[str]) -> dict[str, str | None]:
    """--flag -> value (None for a switch), read with the pinned list's takes_value."""
    table = flag_table(FLAGS)
    out: dict[str, str | None] = {}
    i = 0
    while i < len(words):
        w = words[i]
        if w.startswith("--"):
            name = w[2:]
            assert name in table.flags, f"Megatron-LM {table.version} has no {w}"
            spec = table.flags[name]
            assert not spec.get("deprecated"), f"{w} is deprecated in {table.version}"
            if spec.get("nargs") in ("+", "*"):  # every word up to the next flag, space-joined
                values = []
                while i + 1 < len(words) and not words[i + 1].startswith("--") and not words[i + 1].startswith("$"):
                    values.append(words[i + 1])
                    i += 1
                out[name] = " ".join(values)
            elif spec.get("takes_value", True):
                value = words[i + 1]
                if "choices" in spec and not value.startswith("$"):
                    assert value in [str(c) for c in spec["choices"]], (w, value)
                out[name] = value
                i += 1
            else:
                out[name] = None
        i += 1
    return out


# ----- Megatron-LM ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", MEGATRON_PLANS)
def test_every_megatron_flag_is_in_the_pinned_parsers_list(name):
    words = megatron_argv(name)
    assert len(flags_of(words)) >= 20
    text = files("megatron", name)["pretrain.sh"]
    data_line = next(line for line in text.splitlines() if line.startswith("if [ -n \"$DATA_PATH\" ]"))
    for flag in ("--data-path", "--split", "--mock-data"):  # the data words, outside the command
        assert flag in data_line and flag[2:] in flag_table(FLAGS).flags


def test_megatron_flag_list_is_megatrons_own_and_can_fail():
    t = flag_table(FLAGS)
    assert t.version == "0.19.0" and "core_v0.19.0" in t.sources[0] and len(t.flags) > 500
    assert t.flags["use-rotary-position-embeddings"].get("deprecated")  # "Deprecated: use --position-embedding-type"
    with pytest.raises(AssertionError, match="Megatron-LM 0.19.0 has no --virtual-pipeline-model-parallel-size"):
        flags_of(["--virtual-pipeline-model-parallel-size", "2"])  # what 0.19 no longer takes
    with pytest.raises(AssertionError, match="deprecated"):
        flags_of(["--use-rotary-position-embeddings"])


def test_megatron_3d_plan_carries_every_degree_and_the_interleaving():
    m = any_plan("train-3d-1node")
    f = flags_of(megatron_argv("train-3d-1node"))
    L = m.layout
    assert (f["tensor-model-parallel-size"], f["pipeline-model-parallel-size"]) == (str(L.tp), str(L.pp))
    # Megatron derives vp = layers / pp / this (validate_args): the plan's 2 virtual stages
    assert int(f["num-layers-per-virtual-pipeline-stage"]) == m.model.num_layers // (L.pp * L.virtual_stages) == 8
    first_chunk = m.placement.stages[0].layer_ranges[0]
    assert first_chunk[1] - first_chunk[0] + 1 == 8
    assert "sequence-parallel" in f and "use-distributed-optimizer" in f  # ZeRO-1 over dp=2
    assert f["recompute-granularity"] == "selective" and "recompute-method" not in f  # Megatron asserts that
    assert (f["micro-batch-size"], f["global-batch-size"], f["seq-length"]) == ("1", "32", "4096")
    assert (f["num-layers"], f["hidden-size"], f["ffn-hidden-size"], f["num-attention-heads"]) == ("32", "4096", "14336", "32")
    assert "group-query-attention" in f and f["num-query-groups"] == "8" and "swiglu" in f
    assert f["normalization"] == "RMSNorm" and f["position-embedding-type"] == "rope"
    assert "untie-embeddings-and-output-weights" in f and "bf16" in f
    world = L.tp * L.pp * L.dp
    words = argv(files("megatron", "train-3d-1node")["pretrain.sh"].split("torchrun \\", 1)[1])
    assert words[words.index("--nproc-per-node") + 1] == str(world)  # dp = world / (tp x pp) = 2 in Megatron


def test_megatron_full_recompute_and_uneven_split_flags():
    m = any_plan("train-2node")
    L = m.layout.model_copy(update={"recompute": "full", "pp_embedding_as_layer": True, "pp_loss_as_layer": True})
    f = flags_of(_megatron_words(m.model_copy(update={"layout": L})))
    assert (f["recompute-granularity"], f["recompute-method"], f["recompute-num-layers"]) == ("full", "uniform", "1")
    assert "account-for-embedding-in-pipeline-split" in f and "account-for-loss-in-pipeline-split" in f
    L = m.layout.model_copy(update={"pp_first_stage_layers": 38, "pp_last_stage_layers": 42, "virtual_stages": 2,
                                    "pp_schedule": "interleaved"})
    f = flags_of(_megatron_words(m.model_copy(update={"layout": L})))
    assert (f["decoder-first-pipeline-num-layers"], f["decoder-last-pipeline-num-layers"]) == ("38", "42")
    # validate_args: uneven stages take the virtual degree, not layers per virtual stage
    assert f["num-virtual-stages-per-pipeline-rank"] == "2" and "num-layers-per-virtual-pipeline-stage" not in f


def test_megatron_recompute_modules_and_the_fp8_recipe_they_need(cli, tmp_path):
    """A plan that recomputes the MoE activation under fp8 exports Megatron's own list (nargs: one word a
    module) and the current-scaling recipe Megatron-Core requires for moe_act (core_v0.14.0
    transformer_config.py: "Delayed scaling does not support moe_act and layernorm recompute for fp8")."""
    plan = tmp_path / "plan.yaml"
    base = ["recommend", "mixtral-8x7b", "--gpus", "16", "--workload", "training", "--stack", "megatron",
            "--seq-len", "4096", "--global-batch-size", "256", "--recompute", "selective", "--tp", "2", "--ep", "8",
            "--zero-stage", "1"]
    res = cli(*base, "--recompute-modules", "core_attn,moe_act", "--matmul-dtype", "fp8", "-o", str(plan), "--json")
    assert res.exit_code == 0, res.stderr
    import yaml

    assert yaml.safe_load(plan.read_text())["workload"]["recompute_modules"] == ["core_attn", "moe_act"]
    out = tmp_path / "out"
    assert cli("export", str(plan), "--to", "megatron", "-o", str(out)).exit_code == 0
    text = (out / "pretrain.sh").read_text()
    words = argv(text[text.index("torchrun \\"):])
    f = flags_of(words[next(i for i, w in enumerate(words) if w.endswith("pretrain_gpt.py")) + 1:])
    assert f["recompute-granularity"] == "selective" and f["recompute-modules"] == "core_attn moe_act"
    assert (f["fp8-format"], f["fp8-recipe"]) == ("hybrid", "tensorwise")
    # Megatron's default modules (core_attn alone) and delayed scaling are not written out
    res = cli(*base, "--matmul-dtype", "fp8", "-o", str(plan), "--json")
    assert res.exit_code == 0, res.stderr
    assert cli("export", str(plan), "--to", "megatron", "-o", str(out)).exit_code == 0
    text = (out / "pretrain.sh").read_text()
    assert "--recompute-granularity selective" in text and "--recompute-modules" not in text
    assert "--fp8-recipe" not in text


def test_megatron_bf16_gradients_export_grad_reduce_in_bf16_and_a_plan_reads_them_back(cli, tmp_path):
    """--grad-reduce-dtype bf16 goes into the manifest and out as Megatron-LM's --grad-reduce-in-bf16
    (arguments.py at core_v0.19.0 then leaves accumulate_allreduce_grads_in_fp32 off); fp32, its
    default under --bf16, writes nothing."""
    import yaml

    plan, out = tmp_path / "plan.yaml", tmp_path / "out"
    base = ["recommend", "llama-3.1-8b", "--gpus", "8", "--workload", "training", "--stack", "megatron",
            "--seq-len", "8192", "--global-batch-size", "128", "--tp", "1", "--cp", "2", "--zero-stage", "1"]
    for grads, expected in (("bf16", True), ("fp32", False)):
        res = cli(*base, "--grad-reduce-dtype", grads, "-o", str(plan), "--json")
        assert res.exit_code == 0, res.stderr
        assert yaml.safe_load(plan.read_text())["workload"]["grad_reduce_dtype"] == grads
        assert cli("export", str(plan), "--to", "megatron", "-o", str(out)).exit_code == 0
        text = (out / "pretrain.sh").read_text()
        words = argv(text[text.index("torchrun \\"):])
        f = flags_of(words[next(i for i, w in enumerate(words) if w.endswith("pretrain_gpt.py")) + 1:])
        assert ("grad-reduce-in-bf16" in f) is expected and f["bf16"] is None


def _megatron_words(m) -> list[str]:
    from shardplan.specs.loading import load_model

    text = export(m, "megatron", spec=load_model(m.model.name).spec)[0].text
    words = argv(text[text.index("torchrun \\"):])
    return words[next(i for i, w in enumerate(words) if w.endswith("pretrain_gpt.py")) + 1:]


# ----- torchtitan ----------------------------------------------------------------------------


def _keys(cfg: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in cfg.items():
        if isinstance(v, dict):
            out += _keys(v, f"{prefix}{k}.")
        else:
            out.append(f"{prefix}{k}")
    return out


@pytest.mark.parametrize("name", TORCHTITAN_PLANS)
def test_torchtitan_toml_parses_and_every_key_is_a_pinned_job_config_field(name):
    cfg = tomllib.loads(files("torchtitan", name)["train.toml"])
    table = flag_table(KEYS)
    keys = _keys(cfg)
    assert len(keys) >= 15
    for key in keys:
        assert key in table.flags, f"torchtitan {table.version} has no {key}"
        choices = table.flags[key].get("choices")
        if choices is not None:
            assert cfg_value(cfg, key) in choices, key


def cfg_value(cfg: dict, key: str):
    for part in key.split("."):
        cfg = cfg[part]
    return cfg


def test_torchtitan_3d_plan_degrees_schedule_split_and_checkpointing():
    m = any_plan("train-3d-1node-fsdp")
    cfg = tomllib.loads(files("torchtitan", "train-3d-1node-fsdp")["train.toml"])
    p = cfg["parallelism"]
    L = m.layout
    assert (p["tensor_parallel_degree"], p["pipeline_parallel_degree"], p["data_parallel_shard_degree"]) == (2, 2, 2)
    assert p["data_parallel_replicate_degree"] * p["data_parallel_shard_degree"] * p["tensor_parallel_degree"] \
        * p["pipeline_parallel_degree"] * p["context_parallel_degree"] == m.hardware.num_gpus
    assert p["pipeline_parallel_schedule"] == "Interleaved1F1B" and p["pipeline_parallel_microbatch_size"] == 1
    parts = p["module_fqns_per_model_part"]
    assert len(parts) == L.pp * L.virtual_stages and parts[0][0] == "tok_embeddings" and parts[-1][-2:] == ["norm", "output"]
    layers = [int(x.split(".")[1]) for part in parts for x in part if x.startswith("layers.")]
    assert layers == list(range(m.model.num_layers))
    assert parts[2][0] == f"layers.{m.placement.stages[0].layer_ranges[1][0]}"  # stage 0's second chunk
    assert cfg["activation_checkpoint"] == {"mode": "selective", "selective_ac_option": "op"}
    assert cfg["training"]["global_batch_size"] == 32 and cfg["training"]["local_batch_size"] == 32 // L.dp
    assert cfg["model"]["name"] == "llama3" and cfg["model"]["flavor"] == "8B"


def test_torchtitan_fp8_plan_gets_the_float8_converter():
    m = any_plan("train-3d-1node-fsdp")
    m = m.model_copy(update={"workload": m.workload.model_copy(update={"matmul_dtype": "fp8"})})
    from shardplan.specs.loading import load_model

    cfg = tomllib.loads(export(m, "torchtitan", spec=load_model("llama-3.1-8b").spec)[0].text)
    assert cfg["model"]["converters"] == ["quantize.linear.float8"]
    assert cfg["quantize"]["linear"]["float8"]["recipe_name"] == "tensorwise"


def test_torchtitan_run_script_points_torchrun_at_the_toml():
    text = files("torchtitan", "train-3d-1node-fsdp")["run.sh"]
    words = argv(text[text.index("torchrun \\"):])
    assert words[-4:] == ["-m", "torchtitan.train", "--job.config_file", "train.toml"]
    custom = files("torchtitan", "train-3d-1node-fsdp", script="my_train.py --seed 1")["run.sh"]
    assert argv(custom[custom.index("torchrun \\"):])[-5:] == ["my_train.py", "--seed", "1", "--job.config_file", "train.toml"]


# ----- refusals ------------------------------------------------------------------------------


@pytest.mark.parametrize("target,name,update,field,words", [
    ("megatron", "train-1node", {}, "layout.zero_stage", "ZeRO stage 3"),
    ("megatron", "serve-1gpu", {}, "workload.kind", "serving plan"),
    ("megatron", "train-3d-1node", {"offload_optimizer": "cpu"}, "layout.offload_optimizer", "offload"),
    ("megatron", "train-2node", {"pp_schedule": "gpipe"}, "layout.pp_schedule", "GPipe"),
    ("torchtitan", "train-3d-1node", {}, "layout.zero_stage", "ZeRO stage 1"),
    ("torchtitan", "train-1gpu", {}, "model", "none has this model's shape"),
    ("torchtitan", "train-3d-1node-fsdp", {"zero_stage": 0}, "layout.zero_stage", "DDP"),
])
def test_a_plan_a_trainer_cannot_express_is_refused_with_the_reason(target, name, update, field, words):
    m = any_plan(name)
    if update:
        m = m.model_copy(update={"layout": m.layout.model_copy(update=update)})
    from shardplan.specs.loading import load_model

    with pytest.raises(CannotExpress) as info:
        export(m, target, spec=load_model(m.model.name.replace("evil", "")).spec)
    assert info.value.field == field and words in info.value.message, info.value.message
    assert info.value.message.startswith(f"{target} cannot express this plan: ")


def test_cli_trainer_refusal_is_one_line_exit_2(cli, tmp_path):
    from shardplan.plan.manifest import write_manifest

    for target, name in (("megatron", "train-1node"), ("torchtitan", "train-3d-1node")):  # ZeRO-3, ZeRO-1
        p = tmp_path / f"{name}.yaml"
        write_manifest(any_plan(name), p)
        r = cli("export", str(p), "--to", target)
        assert r.exit_code == 2 and "Traceback" not in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and f"{target} cannot express this plan" in r.stderr


def test_run_helper_reaches_both_trainers():
    assert [f.name for f in run("megatron", "train-1gpu")] == ["pretrain.sh"]
    assert [f.name for f in run("torchtitan", "train-1gpu-h200")] == ["train.toml", "run.sh"]


# ----- the consumer's own code ---------------------------------------------------------------


def _torchtitan_config_manager():
    """torchtitan 0.2.2's ConfigManager, imported without torchtitan/__init__.py (which imports
    GPU kernels and needs triton); the test extra installs torchtitan 0.2.2 and tyro."""
    loaded = sys.modules.get("torchtitan")
    spec = loaded.__spec__ if loaded is not None else importlib.util.find_spec("torchtitan")
    if spec is None or importlib.util.find_spec("tyro") is None:
        pytest.fail("torchtitan 0.2.2 is not installed: it is a test dependency (pip install -e '.[test]')")
    if "torchtitan.config.manager" not in sys.modules:
        pkg = types.ModuleType("torchtitan")
        pkg.__path__, pkg.__spec__ = list(spec.submodule_search_locations), spec
        sys.modules.setdefault("torchtitan", pkg)
    from importlib.metadata import version

    from torchtitan.config.manager import ConfigManager

    assert version("torchtitan") == flag_table(KEYS).version
    return ConfigManager


@pytest.mark.consumers
@pytest.mark.parametrize("name", TORCHTITAN_PLANS)
def test_torchtitan_config_manager_loads_the_toml_with_the_plans_values(name, tmp_path):
    ConfigManager = _torchtitan_config_manager()
    (tmp_path / "train.toml").write_text(files("torchtitan", name)["train.toml"])
    cfg = ConfigManager().parse_args(["--job.config_file", str(tmp_path / "train.toml")])
    m = any_plan(name)
    L = m.layout
    assert cfg.parallelism.tensor_parallel_degree == L.tp and cfg.parallelism.pipeline_parallel_degree == L.pp
    assert cfg.training.seq_len == m.workload.seq_len and cfg.activation_checkpoint.mode == L.recompute
    # a key that is not a JobConfig field is refused by the same code (so the check above can fail)
    (tmp_path / "bad.toml").write_text("[parallelism]\ntensor_parallel_size = 2\n")
    with pytest.raises(ValueError, match="Invalid field names"):
        ConfigManager().parse_args(["--job.config_file", str(tmp_path / "bad.toml")])


@pytest.mark.consumers
@pytest.mark.parametrize("name", TORCHTITAN_PLANS)
def test_torchtitan_pipeline_schedule_names_a_torch_schedule(name):
    from torch.distributed.pipelining.schedules import get_schedule_class

    p = tomllib.loads(files("torchtitan", name)["train.toml"])["parallelism"]
    if p["pipeline_parallel_degree"] > 1:
        cls = get_schedule_class(p["pipeline_parallel_schedule"])
        assert cls.__name__.startswith("Schedule")


def test_the_distributed_optimizer_spans_context_parallel_ranks_too():
    """ZeRO-1 with dp = 1 and cp = 2 still shards the optimizer over 2 ranks (Megatron-Core's
    distributed optimizer uses the data-parallel group with the context-parallel ranks, as the plan
    counts it), so the export turns it on; with dp = cp = 1 there is nothing to shard."""
    from conftest import build_plan
    from shardplan.cost.inputs import training_workload
    from shardplan.cost.layout import Layout, Recompute
    from shardplan.exporters import ExportOptions, export
    from shardplan.exporters.base import argv
    from shardplan.knowledge.load import stack_rules
    from shardplan.specs.loading import load_model

    spec = load_model("llama-3.1-8b").spec
    wl = training_workload(seq_len=2048, global_batch_size=8, optimizer="adamw", framework=None, flash_attention=None,
                           dropout=False, stack=stack_rules("megatron"), spec=spec)
    for cp, expected in ((2, True), (1, False)):
        layout = Layout(tp=4, cp=cp, dp=1, zero_stage=1, sequence_parallel=True, recompute=Recompute.FULL)
        m, _ = build_plan("llama-3.1-8b", 4 * cp, layout, wl)
        text = next(f.text for f in export(m, "megatron", spec=spec, options=ExportOptions()) if f.name == "pretrain.sh")
        words = argv(text[text.index("torchrun \\"):])
        assert ("--use-distributed-optimizer" in words) is expected, cp
