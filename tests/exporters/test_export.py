"""`shardplan export`: golden files per target for a single-GPU, a single-node multi-GPU and a
multi-node plan; every engine flag checked against the pinned version's documented list;
plans a target cannot express refused with the reason; the CLI writes files atomically.

Golden files live in tests/snapshots/exports/<plan>/<target>/; regenerate them after an
intended change with SHARDPLAN_UPDATE_SNAPSHOTS=1 and review the diff."""

from __future__ import annotations

import json
import os
import stat
from dataclasses import replace
from functools import lru_cache
from pathlib import Path

import pytest
import yaml
from conftest import build_plan

from shardplan.cost.layout import Layout, PipelineSchedule, Recompute
from shardplan.cost.workload import InferenceWorkload, TrainingWorkload
from shardplan.errors import ShardplanError
from shardplan.exporters import TARGETS, CannotExpress, ExportOptions, PlanDoesNotFit, export
from shardplan.exporters.base import GIB, argv, flag_table
from shardplan.plan.manifest import write_manifest
from shardplan.specs.loading import load_model

SNAPSHOTS = Path(__file__).parents[1] / "snapshots" / "exports"
UPDATE = os.environ.get("SHARDPLAN_UPDATE_SNAPSHOTS") == "1"


@lru_cache(maxsize=None)
def plan(name: str):
    """The plans every target is tried on (pinned layouts, real estimates)."""
    cases = {
        # serving
        "serve-1gpu": ("llama-3.1-8b", 1, Layout(), InferenceWorkload(max_model_len=8192), None),
        "serve-1node": ("llama-3.1-70b", 8, Layout(tp=4, dp=2), InferenceWorkload(max_model_len=32768), None),
        "serve-2node-replicas": ("llama-3.1-70b", 16, Layout(tp=4, dp=4), InferenceWorkload(max_model_len=32768), 8),
        "serve-2node-span": ("llama-3.1-405b", 16, Layout(tp=8, pp=2), InferenceWorkload(max_model_len=8192), 8),
        "serve-pp-1node": ("llama-3.1-8b", 2, Layout(pp=2), InferenceWorkload(max_model_len=8192), None),
        "serve-moe-ep": ("mixtral-8x7b", 8, Layout(tp=2, dp=4, ep=2), InferenceWorkload(max_model_len=32768), None),
        # every expert in each replica, split by tensor parallelism (ep 1)
        "serve-moe-tp": ("mixtral-8x7b", 8, Layout(tp=4, dp=2), InferenceWorkload(max_model_len=32768), None),
        # expert parallelism spanning replicas: one engine per expert group (DeepSeek-V3 as the issue names it)
        "serve-dp-ep-1node": ("mixtral-8x7b", 8, Layout(tp=2, dp=4, ep=8), InferenceWorkload(max_model_len=32768), None),
        "serve-dp-ep-2node": ("deepseek-v3", 16, Layout(tp=1, dp=16, ep=16), InferenceWorkload(max_model_len=8192),
                              (8, "h200-sxm-141gb")),
        # training
        "train-1gpu": ("llama-3.2-1b", 1, Layout(), TrainingWorkload(seq_len=2048, global_batch_size=16), None),
        "train-1node": ("llama-3.1-8b", 8, Layout(dp=8, zero_stage=3, micro_batch_size=2),
                        TrainingWorkload(seq_len=4096, global_batch_size=64), None),
        "train-2node": ("llama-3.1-70b", 16, Layout(tp=8, pp=2, zero_stage=1, sequence_parallel=True,
                                                    recompute=Recompute.SELECTIVE),
                        TrainingWorkload(seq_len=4096, global_batch_size=64), 8),
    }
    model, gpus, layout, wl, gpn = cases[name]
    gpn, hardware = gpn if isinstance(gpn, tuple) else (gpn, "h100-sxm-80gb")
    m, _ = build_plan(model, gpus, layout, wl, gpus_per_node=gpn, hardware=hardware)
    assert m.predicted.fits, name
    return m


SERVING = ["serve-1gpu", "serve-1node", "serve-2node-span"]
TRAINING = ["train-1gpu", "train-1node", "train-2node"]
# target -> the plans of its golden files (single GPU, one node, several nodes)
GOLDEN = {
    "vllm": [*SERVING, "serve-2node-replicas", "serve-moe-ep", "serve-dp-ep-1node", "serve-dp-ep-2node"],
    "sglang": [*SERVING, "serve-moe-ep", "serve-dp-ep-1node", "serve-dp-ep-2node"],
    "tgi": ["serve-1gpu", "serve-1node", "serve-2node-replicas"],
    "trtllm": ["serve-1gpu", "serve-1node", "serve-2node-replicas"],
    "llamacpp": ["serve-1gpu", "serve-1node", "serve-2node-replicas"],
    "deepspeed": ["train-1gpu", "train-1node", "train-2node-zero"],
    "torchrun": [*TRAINING, "serve-1node"],
    "slurm": TRAINING,
    "megatron": ["train-1gpu", "train-3d-1node", "train-2node"],
    "torchtitan": ["train-1gpu-h200", "train-3d-1node-fsdp", "train-2node"],
    "accelerate": ["serve-1gpu", "serve-pp-1node", "train-1gpu", "train-1node", "train-2node-fsdp"],
    "kubernetes": [*SERVING, "serve-2node-replicas", "serve-dp-ep-2node", *TRAINING],
    "jax": ["serve-1gpu", "serve-1node", "train-1node", "train-2node-dp"],
}


THREE_D = Layout(tp=2, pp=2, dp=2, zero_stage=1, sequence_parallel=True, recompute=Recompute.SELECTIVE,
                 pp_schedule=PipelineSchedule.INTERLEAVED, virtual_stages=2)


@lru_cache(maxsize=None)
def any_plan(name: str):
    """`plan` plus variants some targets need (DeepSpeed/FSDP/JAX cannot run tp x pp)."""
    extra = {
        "train-2node-zero": ("llama-3.1-8b", 16, Layout(dp=16, zero_stage=2, micro_batch_size=1),
                             TrainingWorkload(seq_len=4096, global_batch_size=128)),
        "train-2node-fsdp": ("llama-3.1-70b", 16, Layout(tp=8, dp=2, zero_stage=3, sequence_parallel=True),
                             TrainingWorkload(seq_len=4096, global_batch_size=64)),
        "train-2node-dp": ("llama-3.1-8b", 16, Layout(tp=2, dp=8, zero_stage=3),
                           TrainingWorkload(seq_len=4096, global_batch_size=128)),
        # 3D for the trainers (tests/exporters/test_export_trainers.py): tp x pp x dp, 2 virtual stages,
        # sequence parallel, selective recompute; ZeRO-1 for Megatron, FSDP2 (ZeRO-3) for torchtitan
        "train-3d-1node": ("llama-3.1-8b", 8, THREE_D, TrainingWorkload(seq_len=4096, global_batch_size=32)),
        "train-3d-1node-fsdp": ("llama-3.1-8b", 8, replace(THREE_D, zero_stage=3),
                                TrainingWorkload(seq_len=4096, global_batch_size=32)),
        # one GPU of a model torchtitan has a flavor for
        "train-1gpu-h200": ("llama-3.1-8b", 1, Layout(recompute=Recompute.FULL),
                            TrainingWorkload(seq_len=2048, global_batch_size=8), "h200-sxm-141gb"),
    }
    if name not in extra:
        return plan(name)
    model, gpus, layout, wl, *hardware = extra[name]
    m, _ = build_plan(model, gpus, layout, wl, gpus_per_node=8, **({"hardware": hardware[0]} if hardware else {}))
    assert m.predicted.fits, name
    return m


def run(target: str, name: str, **opts):
    m = any_plan(name)
    return export(m, target, spec=load_model(m.model.name).spec, options=ExportOptions(plan_file="plan.yaml", **opts))


def files(target: str, name: str, **opts) -> dict[str, str]:
    return {f.name: f.text for f in run(target, name, **opts)}


def test_every_target_has_goldens_for_one_gpu_one_node_and_several_nodes():
    assert set(GOLDEN) == set(TARGETS)
    for target, names in GOLDEN.items():
        nodes = {any_plan(n).hardware.num_nodes for n in names}
        gpus = {any_plan(n).hardware.num_gpus for n in names}
        if target != "accelerate":  # device maps are single-node by nature
            assert max(nodes) > 1, target
        assert min(gpus) == 1, target
        assert any(any_plan(n).hardware.num_nodes == 1 and any_plan(n).hardware.num_gpus > 1 for n in names), target


@pytest.mark.parametrize("target,name", [(t, n) for t, ns in GOLDEN.items() for n in ns])
def test_export_matches_its_golden_files(target, name):
    got = files(target, name)
    folder = SNAPSHOTS / name / target
    if UPDATE:
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.iterdir():
            old.unlink()
        for fname, text in got.items():
            (folder / fname).write_text(text)
    want = {p.name: p.read_text() for p in sorted(folder.iterdir())}
    assert sorted(got) == sorted(want)
    for fname in got:
        assert got[fname] == want[fname], f"{name}/{target}/{fname} differs (SHARDPLAN_UPDATE_SNAPSHOTS=1 to accept)"


# ----- every flag against the pinned list -------------------------------------------------

ENGINE_COMMANDS = {  # program words -> flag list
    ("vllm", "serve"): "vllm",
    ("ray", "start"): "ray",
    ("python", "-m", "sglang.launch_server"): "sglang",
    ("text-generation-launcher",): "tgi",
    ("trtllm-serve",): "trtllm-serve",
    ("trtllm-build",): "trtllm-build",
    ("llama-server",): "llamacpp-b11312",
}


def engine_commands(text: str):
    """(flag list name, argv after the program) for each engine command in a script or pod spec."""
    joined = text.replace("\\\n", " ")
    for line in joined.splitlines():
        words = argv(line.split(" #")[0]) if not line.lstrip().startswith("#") else []
        words = [w for w in words if "=" not in w or w.startswith("-")]  # drop VAR=value prefixes
        for i in range(len(words)):
            for prog, table in ENGINE_COMMANDS.items():
                if tuple(words[i:i + len(prog)]) == prog:
                    yield table, words[i + len(prog):]


def pod_shells(text: str) -> list[str]:
    """The shell commands of every container in Kubernetes YAML (Deployment, LeaderWorkerSet, Job)."""
    out = []

    def walk(node):
        if isinstance(node, dict):
            if "containers" in node:
                out.extend(c["args"][0] for c in node["containers"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    for doc in yaml.safe_load_all(text):
        walk(doc)
    return out


def check_flags(table_name: str, args: list[str]) -> int:
    """Every --flag is in the pinned list, takes a value iff documented, the value among its choices."""
    t = flag_table(table_name)
    n, i = 0, 0
    while i < len(args):
        word = args[i]
        if word in ("&&", "&", ";"):
            break
        if word.startswith(t.prefix):
            name = word[len(t.prefix):]
            assert name in t.flags, f"{t.command} {t.version} documents no {word}"
            assert not t.flags[name].get("deprecated"), f"{t.command} {t.version} marks {word} deprecated"
            if t.flags[name].get("takes_value", True):
                value = args[i + 1]
                choices = t.flags[name].get("choices")
                if choices is not None and not value.startswith("$"):
                    assert value in [str(c) for c in choices], f"{word} {value} not in {choices}"
                i += 1
            n += 1
        i += 1
    return n


@pytest.mark.parametrize("target", ["vllm", "sglang", "tgi", "trtllm", "llamacpp", "kubernetes"])
def test_every_engine_flag_is_in_the_pinned_versions_list(target):
    names = [n for n in GOLDEN[target] if n.startswith("serve")] + ["serve-2node-replicas", "serve-moe-ep",
                                                                     "serve-dp-ep-1node", "serve-dp-ep-2node"]
    checked = 0
    for name in dict.fromkeys(names):
        try:
            texts = files(target, name)
        except CannotExpress:
            continue
        for fname, text in texts.items():
            if fname.endswith(".txt"):  # prose (llamacpp's README.txt), not a script
                continue
            for shell in pod_shells(text) if fname.endswith(".yaml") else [text]:
                for table, args in engine_commands(shell):
                    checked += check_flags(table, args)
    assert checked >= 20, checked


def test_flag_lists_name_their_version_and_source():
    for path in (Path(__file__).parents[2] / "shardplan" / "exporters" / "flags").glob("*.yaml"):
        t = flag_table(path.stem)
        assert t.version and (t.version[0].isdigit() or t.version[1:].isdigit()), path.name  # llama.cpp: b<build>
        assert all(s.startswith("https://") for s in t.sources), path.name
        assert len(t.flags) >= 5, path.name


def test_a_flag_outside_the_pinned_list_is_an_exporter_bug():
    t = flag_table("vllm")
    with pytest.raises(AssertionError, match="no flag --tensor-parallel"):
        t.check("tensor-parallel", "2")
    with pytest.raises(AssertionError, match="not one of"):
        t.check("dtype", "fp9")  # vLLM 0.33 checks --kv-cache-dtype after parsing: only --dtype has choices
    with pytest.raises(AssertionError, match="takes no value"):
        t.check("enforce-eager", "true")


# ----- what the commands say --------------------------------------------------------------


def _flag(text: str, table: str, name: str) -> str | None:
    for tname, args in engine_commands(text):
        if tname == table and f"--{name}" in args:
            i = args.index(f"--{name}")
            return args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else ""
    return None


def test_vllm_takes_the_plans_degrees_and_limits():
    m = plan("serve-1node")
    text = files("vllm", "serve-1node")["serve.sh"]
    assert _flag(text, "vllm", "tensor-parallel-size") == "4"
    assert _flag(text, "vllm", "data-parallel-size") == "2"
    assert _flag(text, "vllm", "max-model-len") == "32768"
    assert _flag(text, "vllm", "gpu-memory-utilization") == "0.90"
    assert _flag(text, "vllm", "max-num-seqs") == str(m.workload.max_num_seqs)
    assert _flag(text, "vllm", "enforce-eager") is None
    assert "vllm serve meta-llama/Llama-3.1-70B" in text


def test_vllm_runs_one_server_per_replica_when_experts_are_split_per_replica():
    text = files("vllm", "serve-moe-ep")["serve.sh"]
    assert text.count("vllm serve") == 4  # --data-parallel-size would make vLLM's ep = tp x dp = 8
    assert "--data-parallel-size" not in text and text.count("--enable-expert-parallel") == 4
    assert [f"CUDA_VISIBLE_DEVICES={d}" in text for d in ("0,1", "2,3", "4,5", "6,7")] == [True] * 4
    assert [f"--port {p}" in text for p in (8000, 8001, 8002, 8003)] == [True] * 4


def test_vllm_runs_one_server_per_replica_when_each_replica_holds_every_expert():
    """vLLM's data parallelism flattens tp across dp for the MoE layers with or without
    --enable-expert-parallel (FusedMoEParallelConfig.make): one server with --data-parallel-size 2
    would split Mixtral's experts 8 ways and tie the two replicas' steps together, not run the
    plan's two independent tp 4 replicas."""
    m = plan("serve-moe-tp")
    assert m.model.num_experts and m.layout.ep == 1 and m.layout.dp == 2
    cmds = [args for t, args in engine_commands(files("vllm", "serve-moe-tp")["serve.sh"]) if t == "vllm"]
    assert len(cmds) == 2
    for words in cmds:
        assert "--data-parallel-size" not in words and "--enable-expert-parallel" not in words
        assert words[words.index("--tensor-parallel-size") + 1] == "4"
    # a dense plan's replicas still share one server
    assert _flag(files("vllm", "serve-1node")["serve.sh"], "vllm", "data-parallel-size") == "2"


def test_vllm_replica_over_two_nodes_gets_ray_and_a_leader_worker_set():
    out = files("vllm", "serve-2node-span")
    assert sorted(out) == ["lws.yaml", "ray-head.sh", "ray-worker.sh", "serve.sh"]
    assert _flag(out["serve.sh"], "vllm", "distributed-executor-backend") == "ray"
    assert _flag(out["serve.sh"], "vllm", "pipeline-parallel-size") == "2"
    lws = next(yaml.safe_load_all(out["lws.yaml"]))
    assert lws["kind"] == "LeaderWorkerSet" and lws["spec"]["leaderWorkerTemplate"]["size"] == 2


def test_vllm_raises_memory_utilization_until_one_max_model_len_sequence_fits():
    # llama-3.1-8b on an L4: at 0.9 the KV cache holds 27,936 tokens, short of 32,768 (vLLM would
    # refuse to start); the export asks for the least share that holds one sequence.
    m, report = build_plan("llama-3.1-8b", 1, Layout(), InferenceWorkload(max_model_len=32768), hardware="l4-24gb")
    assert not m.predicted.fits and m.predicted.kv_cache.capacity_tokens < 32768
    text = export(m, "vllm", options=ExportOptions())[0].text
    util = float(_flag(text, "vllm", "gpu-memory-utilization"))
    kv = m.predicted.kv_cache
    b = m.predicted.memory.per_gpu_bytes
    cap = m.hardware.memory_capacity_bytes
    held = (util * cap - (b["total"] - b["kv_cache"])) / kv.bytes_per_token_per_gpu
    held_below = ((util - 0.01) * cap - (b["total"] - b["kv_cache"])) / kv.bytes_per_token_per_gpu
    assert held >= 32768 > held_below  # the least, to 0.01
    assert 0.9 < util <= 0.95
    longer, _ = build_plan("llama-3.1-8b", 1, Layout(), InferenceWorkload(max_model_len=65536), hardware="l4-24gb")
    with pytest.raises(PlanDoesNotFit, match=r"would need --gpu-memory-utilization 1\.\d\d to hold one 65536-token sequence"):
        export(longer, "vllm")


def test_sglang_static_fraction_is_weights_plus_kv_cache():
    m = plan("serve-1node")
    text = files("sglang", "serve-1node")["serve.sh"]
    b, cap = m.predicted.memory.per_gpu_bytes, m.hardware.memory_capacity_bytes
    frac = float(_flag(text, "sglang", "mem-fraction-static"))
    assert frac == pytest.approx((b["weights"] + b["kv_cache"]) / cap, abs=0.01)
    assert frac <= (b["weights"] + b["kv_cache"]) / cap  # rounded down
    assert _flag(text, "sglang", "dp-size") == "2" and _flag(text, "sglang", "context-length") == "32768"
    moe = files("sglang", "serve-moe-ep")["serve.sh"]
    assert _flag(moe, "sglang", "ep-size") == "2" and _flag(moe, "sglang", "tp-size") == "2"


def test_tgi_runs_each_replica_on_its_own_gpus_ports_and_sockets():
    text = files("tgi", "serve-1node")["serve.sh"]
    assert text.count("text-generation-launcher") == 2
    assert "CUDA_VISIBLE_DEVICES=0,1,2,3" in text and "CUDA_VISIBLE_DEVICES=4,5,6,7" in text
    assert "--master-port 29500" in text and "--master-port 29501" in text
    assert _flag(text, "tgi", "max-total-tokens") == "32768" and _flag(text, "tgi", "max-input-tokens") == "32767"
    assert _flag(text, "tgi", "num-shard") == "4"


def test_deepspeed_batch_arithmetic_matches_the_plan():
    cfg = json.loads(files("deepspeed", "train-1node")["ds_config.json"])
    assert cfg["train_batch_size"] == 64
    assert cfg["train_micro_batch_size_per_gpu"] == 2
    assert cfg["gradient_accumulation_steps"] == 64 // (2 * 8)
    assert cfg["zero_optimization"]["stage"] == 3 and cfg["bf16"] == {"enabled": True}


def test_training_launchers_start_every_rank():
    m = any_plan("train-2node")
    text = files("torchrun", "train-2node")["torchrun.sh"]
    words = argv(text[text.index("torchrun \\"):])
    assert words[words.index("--nnodes") + 1] == "2:2" and words[words.index("--nproc-per-node") + 1] == "8"
    assert m.hardware.num_gpus == 2 * 8 == m.layout.tp * m.layout.pp * m.layout.dp * m.layout.cp
    assert words[-4:] == ["-m", "shardplan", "verify", "plan.yaml"]
    sb = files("slurm", "train-2node")["slurm.sbatch"]
    assert "#SBATCH --nodes=2" in sb and "#SBATCH --gpus-per-node=8" in sb and "#SBATCH --ntasks-per-node=1" in sb
    custom = files("torchrun", "train-1gpu", script="train.py --lr 3e-4")["torchrun.sh"]
    words = argv(custom[custom.index("torchrun \\"):])
    i = words.index("train.py")  # the script and its arguments, then the plan's layout (issue 26)
    assert words[i:] == ["train.py", "--lr", "3e-4", "--tp", "1", "--pp", "1", "--dp", "1", "--cp", "1", "--ep", "1",
                         "--vp", "1", "--zero-stage", "0", "--micro-batch-size", "1", "--global-batch-size", "16",
                         "--seq-len", "2048"]
    deg = argv(files("slurm", "train-2node", script="pretrain_gpt.py")["slurm.sbatch"].split("torchrun \\", 1)[1])
    flag = lambda f: deg[deg.index(f) + 1]  # noqa: E731
    assert (flag("--tp"), flag("--pp"), flag("--dp"), flag("--zero-stage")) == ("8", "2", "1", "1")


def test_elastic_launches_take_min_nodes_and_restarts_from_the_options_and_refuse_impossible_ones():
    """--nnodes MIN:MAX: MAX is the plan's nodes, MIN all of them unless --elastic-min-nodes; the
    restarts reach torchrun, Slurm's requeue limit and the Job's backoffLimit alike."""
    elastic = files("torchrun", "train-2node", elastic_min_nodes=1, max_restarts=5)["torchrun.sh"]
    words = argv(elastic[elastic.index("torchrun \\"):])
    assert (words[words.index("--nnodes") + 1], words[words.index("--max-restarts") + 1]) == ("1:2", "5")
    assert "the rank program must read WORLD_SIZE" in elastic
    sb = files("slurm", "train-2node", max_restarts=5)["slurm.sbatch"]
    assert "MAX_REQUEUES=5\n" in sb and '--nnodes "2:$SLURM_NNODES"' in sb
    job = [o for o in yaml.safe_load_all(files("kubernetes", "train-2node", max_restarts=5)["job.yaml"])
           if o["kind"] == "Job"][0]
    assert job["spec"]["backoffLimit"] == 5 and job["spec"]["template"]["spec"]["restartPolicy"] == "OnFailure"
    m = any_plan("train-2node")
    for opts, field in [({"elastic_min_nodes": 3}, "--elastic-min-nodes"), ({"elastic_min_nodes": 0}, "--elastic-min-nodes"),
                        ({"max_restarts": -1}, "--max-restarts")]:
        for target in ("torchrun", "slurm", "kubernetes"):
            with pytest.raises(ShardplanError) as e:
                export(m, target, options=ExportOptions(**opts))
            assert e.value.field == field


def test_the_rendezvous_id_is_the_plans_and_changes_with_its_layout():
    from shardplan.exporters.torchrun import rdzv_id

    m = any_plan("train-2node")
    assert rdzv_id(m) == rdzv_id(m.model_copy(deep=True)) and rdzv_id(m).startswith("llama-3.1-70b-")
    other = m.model_copy(update={"layout": m.layout.model_copy(update={"tp": 4, "pp": 4})})
    assert rdzv_id(other) != rdzv_id(m)
    assert f'RDZV_ID="${{RDZV_ID:-{rdzv_id(m)}}}"' in files("torchrun", "train-2node")["torchrun.sh"]


def test_kubernetes_sizes_shm_and_requests_the_replicas_gpus():
    objs = list(yaml.safe_load_all(files("kubernetes", "serve-1node")["deployment.yaml"]))
    dep = objs[0]
    assert dep["kind"] == "Deployment" and dep["spec"]["replicas"] == 2
    pod = dep["spec"]["template"]["spec"]
    assert pod["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": 4}
    assert pod["volumes"][0]["emptyDir"] == {"medium": "Memory", "sizeLimit": "5Gi"}
    assert objs[1]["kind"] == "Service"


def test_jax_specs_split_what_tensor_parallelism_splits():
    ns: dict = {}
    src = files("jax", "train-2node-dp")["jax_mesh.py"]
    import types

    fake = types.ModuleType("jax.sharding")
    fake.PartitionSpec = lambda *a: tuple(a)
    import sys

    sys.modules.setdefault("jax", types.ModuleType("jax"))
    old = sys.modules.get("jax.sharding")
    sys.modules["jax.sharding"] = fake
    try:
        exec(compile(src, "jax_mesh.py", "exec"), ns)
    finally:
        if old is None:
            del sys.modules["jax.sharding"]
        else:
            sys.modules["jax.sharding"] = old
    assert ns["MESH_AXES"] == ("data", "context", "tensor") and ns["MESH_SHAPE"] == (8, 1, 2)
    specs = ns["PARTITION_SPECS"]
    assert specs["self_attn.q_proj.weight"] == ("tensor", "data")  # column: out / tp; ZeRO-3: in / dp
    assert specs["self_attn.o_proj.weight"] == ("data", "tensor")  # row: in / tp
    assert specs["embed_tokens.weight"] == ("tensor", "data")  # vocab rows / tp
    assert specs["norm0.weight"] == (None,)
    # every sharded dimension divides by its axis size
    spec = load_model("llama-3.1-8b").spec
    from shardplan.cost.params import block_weights, embedding_weights, head_weights

    sizes = dict(zip(ns["MESH_AXES"], ns["MESH_SHAPE"]))
    for w in (*embedding_weights(spec), *block_weights(spec, False), *head_weights(spec)):
        for dim, axis in zip(w.shape, specs[w.name]):
            assert axis is None or dim % sizes[axis] == 0, (w.name, dim, axis)


# ----- plans a target cannot express ------------------------------------------------------


@pytest.mark.parametrize("target,name,field,words", [
    ("vllm", "train-1node", "workload.kind", "serves models and this is a training plan"),
    ("tgi", "serve-2node-span", "layout.pp", "TGI has no pipeline parallelism"),
    ("tgi", "serve-moe-ep", "layout.ep", "tensor parallelism only"),
    ("deepspeed", "serve-1gpu", "workload.kind", "launches training and this is a serving plan"),
    ("deepspeed", "train-2node", "layout.sequence_parallel", "AutoTP has no Megatron sequence parallelism"),
    ("accelerate", "serve-1node", "layout.tp", "tensor parallelism (tp=4) has no form in it"),
    ("accelerate", "train-2node", "layout.pp", "no pipeline stages"),
    ("jax", "serve-2node-span", "layout.pp", "a JAX mesh has no pipeline stages"),
    ("trtllm", "serve-2node-span", "layout", "needs an MPI launch"),
    ("trtllm", "train-1gpu", "workload.kind", "serves models and this is a training plan"),
])
def test_a_plan_the_target_cannot_express_is_refused_with_the_reason(target, name, field, words):
    with pytest.raises(CannotExpress) as info:
        run(target, name)
    assert info.value.field == field and words in info.value.message
    assert info.value.message.startswith(f"{target} cannot express this plan: ")


@pytest.mark.parametrize("update,field,words", [
    ({"cp": 2, "dp": 4}, "layout.cp", "context parallelism (cp=2)"),
    ({"hybrid_shard": True}, "layout.hybrid_shard", "removed MiCS"),
    ({"sequence_parallel": True, "tp": 2, "dp": 4}, "layout.sequence_parallel", "sequence parallelism"),
])
def test_deepspeed_refuses_layouts_its_config_cannot_hold(update, field, words):
    m, _ = build_plan("llama-3.1-8b", 8, Layout(dp=8, zero_stage=3), TrainingWorkload(global_batch_size=64))
    edited = m.model_copy(update={"layout": m.layout.model_copy(update=update)})
    with pytest.raises(CannotExpress) as info:
        export(edited, "deepspeed")
    assert info.value.field == field and words in info.value.message


# ----- the CLI -----------------------------------------------------------------------------


def _write(tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"{name}.yaml"
    write_manifest(any_plan(name), path)
    return path


def test_cli_writes_every_file_atomically_with_scripts_executable(cli, tmp_path):
    p = _write(tmp_path, "serve-2node-span")
    out = tmp_path / "out" / "vllm"
    r = cli("export", str(p), "--to", "vllm", "-o", str(out), "--json")
    assert r.exit_code == 0, r.stderr
    res = r.json()
    assert sorted(f["name"] for f in res["files"]) == ["lws.yaml", "ray-head.sh", "ray-worker.sh", "serve.sh"]
    assert sorted(os.listdir(out)) == ["lws.yaml", "ray-head.sh", "ray-worker.sh", "serve.sh"]  # no temporaries
    assert os.stat(out / "serve.sh").st_mode & stat.S_IXUSR and not os.stat(out / "lws.yaml").st_mode & stat.S_IXUSR
    for f in res["files"]:
        assert (out / f["name"]).read_text() == f["text"] and f["bytes"] == len(f["text"].encode())


def test_cli_prints_a_single_file_as_is(cli, tmp_path):
    p = _write(tmp_path, "serve-1gpu")
    r = cli("export", str(p), "--to", "sglang")
    assert r.exit_code == 0 and r.stdout.startswith("#!/usr/bin/env bash\n") and "sglang.launch_server" in r.stdout


def test_cli_unknown_target_lists_the_known_ones(cli, tmp_path):
    p = _write(tmp_path, "serve-1gpu")
    r = cli("export", str(p), "--to", "vlm")
    assert r.exit_code == 2 and r.stdout == ""
    assert r.stderr.strip() == ("error: field '--to': unknown export target 'vlm' (fix: did you mean 'vllm'? "
                                f"choose one of {', '.join(TARGETS)})")
    far = cli("export", str(p), "--to", "xyzzy")
    assert far.exit_code == 2 and far.stderr.strip() == ("error: field '--to': unknown export target 'xyzzy' (fix: "
                                                         f"choose one of {', '.join(TARGETS)})")


def test_cli_target_names_are_case_insensitive(cli, tmp_path):
    p = _write(tmp_path, "serve-1gpu")
    assert cli("export", str(p), "--to", "VLLM").stdout == cli("export", str(p), "--to", "vllm").stdout != ""


def test_recommend_export_target_is_checked_before_the_search(cli, tmp_path):
    r = cli("recommend", "llama-3.1-8b", "--gpus", "1", "-o", str(tmp_path / "p.yaml"), "--export", "sglng")
    assert r.exit_code == 2 and "did you mean 'sglang'?" in r.stderr and not (tmp_path / "p.yaml").exists()


def test_cli_cannot_express_names_the_plan_file_and_field(cli, tmp_path):
    p = _write(tmp_path, "serve-2node-span")
    r = cli("export", str(p), "--to", "tgi")
    assert r.exit_code == 2
    assert r.stderr.startswith(f"error: {p}: field 'layout.pp': tgi cannot express this plan: ")
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_cli_refuses_a_plan_that_does_not_fit_with_exit_3(cli, tmp_path):
    m, _ = build_plan("llama-3.1-70b", 1, Layout(), InferenceWorkload(max_model_len=8192))
    assert not m.predicted.fits
    write_manifest(m, tmp_path / "big.yaml")
    r = cli("export", str(tmp_path / "big.yaml"), "--to", "vllm")
    assert r.exit_code == 3 and "the plan does not fit" in r.stderr


def test_recommend_export_writes_the_plan_and_the_export_beside_it(cli, tmp_path):
    r = cli("recommend", "llama-3.1-8b", "--gpus", "2", "-o", str(tmp_path / "plan.yaml"), "--export", "vllm", "--json")
    assert r.exit_code == 0, r.stderr
    res = r.json()
    assert res["export"]["files"] == [str(tmp_path / "serve.sh")]
    text = (tmp_path / "serve.sh").read_text()
    top = res["top"][0]["plan"]
    assert _flag(text, "vllm", "tensor-parallel-size") == str(top["tp"])
    r = cli("recommend", "llama-3.1-8b", "--gpus", "2", "--export", "vllm")
    assert r.exit_code == 2 and "--export needs -o" in r.stderr


def test_export_error_is_a_shardplan_error_subclass():
    assert issubclass(CannotExpress, ShardplanError) and PlanDoesNotFit.exit_code == 3
    assert GIB == 1 << 30


def test_kubernetes_training_job_carries_the_plan_that_verify_reads():
    from shardplan.plan.schema import DeploymentManifest

    objs = list(yaml.safe_load_all(files("kubernetes", "train-2node")["job.yaml"]))
    cm, job = objs[0], objs[1]
    assert cm["kind"] == "ConfigMap" and DeploymentManifest.model_validate(yaml.safe_load(cm["data"]["plan.yaml"])) == plan("train-2node")
    pod = job["spec"]["template"]["spec"]
    mount = next(v for v in pod["containers"][0]["volumeMounts"] if v["name"] == "plan")
    assert pod["containers"][0]["args"][0].endswith(f"-m shardplan verify {mount['mountPath']}/plan.yaml")


def test_every_golden_script_passes_bash_syntax_check():
    import subprocess

    scripts = sorted(p for p in SNAPSHOTS.rglob("*") if p.suffix in (".sh", ".sbatch"))
    assert len(scripts) >= 25
    for p in scripts:
        r = subprocess.run(["bash", "-n", str(p)], capture_output=True, text=True)
        assert r.returncode == 0, f"{p.relative_to(SNAPSHOTS)}: {r.stderr.strip()}"


def test_sglang_and_trtllm_shares_also_grow_until_one_sequence_fits():
    m, _ = build_plan("llama-3.1-8b", 1, Layout(), InferenceWorkload(max_model_len=32768), hardware="l4-24gb")
    kv, b, cap = m.predicted.kv_cache, m.predicted.memory.per_gpu_bytes, m.hardware.memory_capacity_bytes
    sg = float(_flag(export(m, "sglang")[0].text, "sglang", "mem-fraction-static"))
    assert (sg * cap - b["weights"]) / kv.bytes_per_token_per_gpu >= 32768
    assert ((sg - 0.01) * cap - b["weights"]) / kv.bytes_per_token_per_gpu < 32768
    free = cap - (b["total"] - b["kv_cache"])
    trt = float(_flag(export(m, "trtllm")[0].text, "trtllm-serve", "kv_cache_free_gpu_memory_fraction"))
    assert trt * free / kv.bytes_per_token_per_gpu >= 32768 > (trt - 0.01) * free / kv.bytes_per_token_per_gpu


def test_cli_unknown_kubernetes_engine_is_one_line_exit_2(cli, tmp_path):
    r = cli("export", str(_write(tmp_path, "serve-1gpu")), "--to", "kubernetes", "--engine", "foo")
    assert r.exit_code == 2
    assert r.stderr.strip() == "error: field '--engine': unknown serving engine 'foo' (fix: use one of vllm, sglang, tgi, trtllm)"


# ----- issue 26: Kubernetes a platform team merges, dp x ep as one engine, TGI metrics ports ----------


GRID = ["serve-1gpu", "serve-1node", "serve-2node-replicas", "serve-2node-span", "serve-pp-1node", "serve-moe-ep",
        "serve-dp-ep-1node", "serve-dp-ep-2node", "train-1gpu", "train-1node", "train-2node", "train-2node-zero",
        "train-2node-fsdp", "train-2node-dp"]


def kubernetes_files(**opts) -> list[tuple[str, str]]:
    """(label, text) of every Kubernetes file the export grid yields: the kubernetes target for
    each serving engine (training once), and vLLM's own lws.yaml; plans an engine cannot run skipped."""
    out = []
    for name in GRID:
        engines = ["vllm", "sglang", "tgi", "trtllm"] if name.startswith("serve") else ["vllm"]
        for engine in engines:
            try:
                got = files("kubernetes", name, engine=engine, **opts)
            except CannotExpress:
                continue
            out += [(f"{name}/{engine}/{f}", t) for f, t in got.items()]
        if name.startswith("serve"):
            out += [(f"{name}/vllm/{f}", t) for f, t in files("vllm", name, **opts).items() if f.endswith(".yaml")]
    return out


def yaml_anchors(text: str) -> list[str]:
    """Anchors and aliases as a YAML parser sees them (plus their PyYAML spelling in the text)."""
    found = [e.anchor for e in yaml.parse(text) if getattr(e, "anchor", None) is not None]
    import re

    return found + re.findall(r"[&*]id\d+", text)


def test_yaml_anchor_check_can_fail():
    shared = {"app": "x"}
    assert yaml_anchors(yaml.safe_dump({"a": shared, "b": shared})) != []  # what PyYAML writes by default


def test_no_exported_kubernetes_file_has_a_yaml_anchor_or_alias():
    texts = kubernetes_files()
    assert len(texts) >= 25
    for label, text in texts:
        assert yaml_anchors(text) == [], label


def _containers(text: str) -> list[dict]:
    out = []

    def walk(node):
        if isinstance(node, dict):
            out.extend(node.get("containers", []))
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    for doc in yaml.safe_load_all(text):
        walk(doc)
    return out


def test_every_serving_container_is_probed_on_its_health_endpoint_and_reads_the_cache_and_token():
    serving_containers = 0
    for label, text in kubernetes_files():
        for c in _containers(text):
            env = {e["name"]: e for e in c["env"]}
            ref = env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]
            assert ref == {"name": "hf-token", "key": "token", "optional": True}, label
            mounts = {v["name"]: v["mountPath"] for v in c["volumeMounts"]}
            assert env["HF_HOME"]["value"] == mounts["model-cache"], label
            if "ports" not in c:  # an LWS worker or a training pod: no API to probe
                assert "readinessProbe" not in c, label
                continue
            serving_containers += 1
            port = c["ports"][0]["containerPort"]
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                assert c[probe]["httpGet"] == {"path": "/health", "port": port}, (label, probe)
            start = c["startupProbe"]
            assert start["failureThreshold"] * start["periodSeconds"] >= 30 * 60, label  # model loading
    assert serving_containers >= 15


def test_kubernetes_cache_pvc_and_token_secret_are_configurable():
    text = files("kubernetes", "serve-1node", cache_pvc="llama-cache", hf_token_secret="team.hf")["deployment.yaml"]
    pod = next(yaml.safe_load_all(text))["spec"]["template"]["spec"]
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["model-cache"] == {"name": "model-cache", "persistentVolumeClaim": {"claimName": "llama-cache"}}
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "team.hf"
    default = next(yaml.safe_load_all(files("kubernetes", "serve-1node")["deployment.yaml"]))
    assert {"name": "model-cache", "emptyDir": {}} in default["spec"]["template"]["spec"]["volumes"]


@pytest.mark.parametrize("field,value", [("cache_pvc", "Bad_Name"), ("cache_pvc", "x; rm -rf /"),
                                         ("hf_token_secret", "a\nb: c"), ("hf_token_secret", "-x")])
def test_kubernetes_refuses_object_names_that_are_not_dns_names(field, value):
    with pytest.raises(ShardplanError, match="is not a Kubernetes object name"):
        files("kubernetes", "serve-1gpu", **{field: value})


def _vllm_ep(words: list[str]) -> int:
    """vLLM's expert-parallel size for a `vllm serve` argv: tp x dp with --enable-expert-parallel
    (FusedMoEParallelConfig.make), else 1."""
    if "--enable-expert-parallel" not in words:
        return 1
    tp = int(words[words.index("--tensor-parallel-size") + 1])
    dp = int(words[words.index("--data-parallel-size") + 1]) if "--data-parallel-size" in words else 1
    return tp * dp


@pytest.mark.parametrize("name", ["serve-dp-ep-1node", "serve-dp-ep-2node"])
def test_dp_ep_plan_runs_as_one_vllm_engine_whose_expert_parallel_size_is_the_plans(name):
    m = plan(name)
    assert m.layout.ep > m.layout.tp  # the expert group spans replicas
    cmds = [args for t, args in engine_commands(files("vllm", name)["serve.sh"]) if t == "vllm"]
    servers = [a for a in cmds if "--headless" not in a]
    assert len(servers) == 1  # one API server: one engine, not one per replica
    for words in cmds:
        assert _vllm_ep(words) == m.layout.ep
        assert int(words[words.index("--data-parallel-size") + 1]) * m.layout.tp == m.layout.ep
    if m.hardware.num_nodes > 1:  # ranks split over the nodes: each holds gpus_per_node / tp of them
        (head,) = servers
        (worker,) = [a for a in cmds if "--headless" in a]
        local = int(head[head.index("--data-parallel-size-local") + 1])
        assert local * m.layout.tp == m.hardware.gpus_per_node
        assert worker[worker.index("--data-parallel-start-rank") + 1] == f"$(($NODE_RANK * {local}))"


@pytest.mark.parametrize("name", ["serve-dp-ep-1node", "serve-dp-ep-2node"])
def test_dp_ep_plan_runs_as_one_sglang_engine_with_dp_attention_and_the_plans_ep(name):
    m = plan(name)
    (words,) = [args for t, args in engine_commands(files("sglang", name)["serve.sh"]) if t == "sglang"]
    flag = lambda f: words[words.index(f) + 1]  # noqa: E731
    k = m.layout.ep // m.layout.tp
    assert int(flag("--ep-size")) == m.layout.ep
    assert int(flag("--tp-size")) == m.layout.tp * k and int(flag("--attn-dp-size")) == k  # SGLang 0.5.23's DP attention
    assert "--enable-dp-attention" not in words and "--dp-size" not in words  # the deprecated spelling
    assert int(flag("--tp-size")) // int(flag("--attn-dp-size")) == m.layout.tp  # attention tp per DP rank
    assert int(flag("--max-running-requests")) == k * m.workload.max_num_seqs  # SGLang divides it by dp_size
    if m.hardware.num_nodes > 1:
        assert int(flag("--nnodes")) == m.hardware.num_nodes


def test_dp_ep_plan_on_kubernetes_is_one_pod_group_per_engine():
    lws = next(yaml.safe_load_all(files("kubernetes", "serve-dp-ep-2node")["lws.yaml"]))
    assert lws["spec"]["replicas"] == 1 and lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    dep = next(yaml.safe_load_all(files("kubernetes", "serve-dp-ep-1node")["deployment.yaml"]))
    assert dep["spec"]["replicas"] == 1
    assert dep["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": 8}


@pytest.mark.parametrize("target,update,field,words", [
    ("trtllm", {}, "layout.ep", "expert parallelism spans 4 replicas"),
    ("vllm", {"tp": 4, "dp": 2, "ep": 2}, "layout.ep", "ep = tp x dp"),
    ("vllm", {"tp": 4, "dp": 2, "ep": 6}, "layout.ep", "not a whole number of replicas"),
])
def test_expert_groups_an_engine_cannot_run_are_refused(target, update, field, words):
    m = plan("serve-dp-ep-1node")
    m = m.model_copy(update={"layout": m.layout.model_copy(update=update)})
    with pytest.raises(CannotExpress) as info:
        export(m, target)
    assert info.value.field == field and words in info.value.message, info.value.message


def test_tgi_replicas_on_one_node_get_their_own_metrics_port_when_the_chosen_launcher_has_the_flag():
    text = files("tgi", "serve-1node", engine_version="3.2.0")["serve.sh"]
    assert "bind the metrics port 9000" in text  # 3.2.0 has no flag: the script says so
    assert not any("--prometheus-port" in args for t, args in engine_commands(text) if t == "tgi")
    assert "flags checked against TGI 3.2.0 (export --engine-version 3.2.0;" in text
    text = files("tgi", "serve-1node")["serve.sh"]  # the pin, 3.3.7 (PR #3187 came in 3.3.0)
    ports = [args[args.index("--prometheus-port") + 1] for t, args in engine_commands(text) if t == "tgi"]
    assert ports == ["9000", "9001"] and "bind the metrics port" not in text
    assert "flags checked against TGI 3.3.7 (the pinned version: the plan names no engine version;" in text
    assert "maintenance mode" in text


def test_cli_passes_the_cache_pvc_and_token_secret_and_refuses_bad_names_in_one_line(cli, tmp_path):
    p = _write(tmp_path, "serve-1gpu")
    r = cli("export", str(p), "--to", "kubernetes", "--cache-pvc", "models", "--hf-token-secret", "hf")
    assert r.exit_code == 0, r.stderr
    pod = next(yaml.safe_load_all(r.stdout))["spec"]["template"]["spec"]
    assert {"name": "model-cache", "persistentVolumeClaim": {"claimName": "models"}} in pod["volumes"]
    assert pod["containers"][0]["env"][1]["valueFrom"]["secretKeyRef"]["name"] == "hf"
    bad = cli("export", str(p), "--to", "kubernetes", "--cache-pvc", "My Cache")
    assert bad.exit_code == 2 and len(bad.stderr.strip().splitlines()) == 1
    assert "field '--cache-pvc'" in bad.stderr and "is not a Kubernetes object name" in bad.stderr
