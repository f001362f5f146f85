"""Exports checked by the code of the tools that consume them, not by our own reading of them:
kubernetes-validate (API 1.34 schemas, strict), DeepSpeed's `DeepSpeedConfig` and launcher
parser, accelerate's `ClusterConfig`, `accelerate launch` config handling, `ParallelismConfig`
and big-model loading (a real checkpoint dispatched with the exported device_map and compared
logit for logit with the eager model), torch's own `torchrun` parser, and `bash -n`.

Launch lines are read two ways: as text (continuations joined, `shlex.split`), and as the argv
bash itself hands the program when the script runs with the program stubbed out (so variables
like $HEAD_ADDR and $SLURM_NNODES are expanded the way a real run expands them).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import types
from functools import lru_cache
from pathlib import Path
from unittest import mock

import pytest
import yaml

from conftest import build_plan
from shardplan.cost.layout import Layout, Offload, Recompute
from shardplan.cost.workload import InferenceWorkload, TrainingWorkload
from shardplan.exporters import ExportFile, ExportOptions, export
from shardplan.exporters.torchrun import rdzv_id
from shardplan.specs.loading import load_model

# Each check imports the consumer's own code (kubernetes-validate, deepspeed, accelerate,
# transformers, torch) or runs bash: the inner loop leaves them to `-m consumers`.
pytestmark = pytest.mark.consumers

K8S_VERSION = "1.34.0"
GPU = "nvidia.com/gpu"


# ----- plans ----------------------------------------------------------------------------


def fitting(m):
    """Exporters refuse plans that do not fit: every plan here must fit."""
    assert m.predicted.fits, m.predicted.reason
    return m


@lru_cache(maxsize=None)
def serving_8b():
    """llama-3.1-8b: 4 replicas of tp=2 on one 8-GPU node."""
    return fitting(build_plan("llama-3.1-8b", 8, Layout(tp=2, dp=4), InferenceWorkload())[0])


@lru_cache(maxsize=None)
def serving_405b():
    """llama-3.1-405b: one replica of tp=8 x pp=2 over two 8-GPU nodes."""
    return fitting(build_plan("llama-3.1-405b", 16, Layout(tp=8, pp=2), InferenceWorkload(max_model_len=8192),
                              gpus_per_node=8)[0])


@lru_cache(maxsize=None)
def training_70b():
    """llama-3.1-70b on two nodes: tp=8 in a node, pp=2 across them, ZeRO-1. Sequence parallelism is
    on because without it the plan does not fit (94.5 GiB on stage 0) and exporters refuse it."""
    return fitting(build_plan("llama-3.1-70b", 16, Layout(tp=8, pp=2, zero_stage=1, sequence_parallel=True),
                              TrainingWorkload(), gpus_per_node=8)[0])


@lru_cache(maxsize=None)
def training(model: str = "llama-3.1-8b", gpus: int = 8, gpus_per_node: int | None = None, **layout):
    return fitting(build_plan(model, gpus, Layout(**layout), TrainingWorkload(), gpus_per_node=gpus_per_node)[0])


def training_8b_two_nodes():
    """llama-3.1-8b, ZeRO-3 over 16 GPUs on two nodes."""
    return training("llama-3.1-8b", 16, 8, dp=16, zero_stage=3)


@lru_cache(maxsize=None)
def serving_debug_pp2():
    """The bundled tiny llama split in two pipeline stages on two GPUs."""
    return fitting(build_plan("debug", 2, Layout(pp=2), InferenceWorkload(max_model_len=512, input_len=384, output_len=128))[0])


def files(manifest, target: str, **kw) -> dict[str, ExportFile]:
    out = export(manifest, target, **kw)
    names = [f.name for f in out]
    assert len(names) == len(set(names)), names
    return {f.name: f for f in out}


def spec_of(model: str):
    return load_model(model).spec


# ----- reading launch lines ----------------------------------------------------------------

_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def command_argv(text: str, program: tuple[str, ...]) -> list[str]:
    """The words after `program` on the one script line that runs it (continuations joined,
    shlex-split; comments and variable assignments skipped)."""
    found = []
    for line in text.replace("\\\n", " ").splitlines():
        line = line.strip()
        if not line or line.startswith("#") or _ASSIGNMENT.match(line):
            continue
        words = shlex.split(line)
        for i in range(len(words) - len(program) + 1):
            if tuple(words[i:i + len(program)]) == program:
                found.append(words[i + len(program):])
                break
    assert len(found) == 1, f"expected one `{' '.join(program)}` line, found {len(found)} in:\n{text}"
    return found[0]


# Stubs that stand in for the launchers: each records the argv bash passes it (NUL-separated).
_STUBS = r"""
__capture() { printf '%s\0' "$@" > "$CAPTURE"; }
torchrun() { __capture "$@"; }
deepspeed() { __capture "$@"; }
accelerate() { [ "$1" = launch ] || exit 97; shift; __capture "$@"; }
srun() { while [ "${1#-}" != "$1" ]; do shift; done; "$@"; }
scontrol() { [ "$*" = "show hostnames $SLURM_JOB_NODELIST" ] || exit 98; printf 'gpu01\ngpu02\n'; }
"""


def shell_argv(text: str, tmp_path: Path, env: dict[str, str]) -> list[str]:
    """Run the exported script in bash with the launcher stubbed: the argv it really receives."""
    script = tmp_path / "script.sh"
    script.write_text(text)
    capture = tmp_path / "argv.bin"
    run_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "CAPTURE": str(capture), **env}
    proc = subprocess.run(["bash", "-c", _STUBS + '\nsource "$1"', "bash", str(script)], env=run_env,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    words = capture.read_bytes().split(b"\0")
    assert words[-1] == b""
    return [w.decode() for w in words[:-1]]


def bash_syntax_ok(text: str) -> None:
    proc = subprocess.run(["bash", "-n"], input=text, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, f"bash -n: {proc.stderr}\n{text}"


def torchrun_args(argv: list[str]):
    from torch.distributed.run import get_args_parser

    return get_args_parser().parse_args(argv)


def elastic_config(args):
    """torch's own LaunchConfig for parsed torchrun arguments: (config, program, rank argv).
    OMP_NUM_THREADS is preset so that torch does not set it in this process."""
    from torch.distributed.run import config_from_args

    with mock.patch.dict(os.environ, {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}):
        return config_from_args(args)


# ----- 1. Kubernetes ------------------------------------------------------------------------


def k8s_validate(obj: dict) -> None:
    import kubernetes_validate

    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)  # raises on any schema error


def as_pod_template(template: dict) -> dict:
    return {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "x"}, "template": template}


def k8s_objects(text: str) -> list[dict]:
    return [o for o in yaml.safe_load_all(text) if o is not None]


def only_container(pod_template: dict) -> dict:
    containers = pod_template["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def assert_pod_shape(pod_template: dict, gpus: int) -> None:
    """GPUs requested as limits == requests (extended resources must be equal), /dev/shm from a
    memory-backed emptyDir of 1 GiB + 1 GiB per GPU, and a shell command bash accepts."""
    c = only_container(pod_template)
    assert c["resources"]["limits"] == {GPU: gpus}
    assert c["resources"]["requests"] == {GPU: gpus}
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    vols = {v["name"]: v for v in pod_template["spec"]["volumes"]}
    (shm,) = [name for name, path in mounts.items() if path == "/dev/shm"]
    assert vols[shm]["emptyDir"] == {"medium": "Memory", "sizeLimit": f"{1 + gpus}Gi"}
    assert c["command"] == ["/bin/bash", "-c"] and len(c["args"]) == 1
    bash_syntax_ok(c["args"][0])


def test_kubernetes_validator_is_strict_so_the_checks_below_can_fail():
    import kubernetes_validate

    (dep, _) = k8s_objects(files(serving_8b(), "kubernetes")["deployment.yaml"].text)
    only_container(dep["spec"]["template"])["gpus"] = 2  # not a Container field
    with pytest.raises(kubernetes_validate.ValidationError):
        k8s_validate(dep)
    template = dep["spec"]["template"]
    only_container(template).pop("gpus")
    k8s_validate(as_pod_template(template))  # the template as exported passes
    del only_container(template)["volumeMounts"][0]["mountPath"]  # a required field
    with pytest.raises(kubernetes_validate.ValidationError):
        k8s_validate(as_pod_template(template))


@pytest.mark.parametrize("engine,program", [("vllm", ("vllm", "serve")),
                                            ("sglang", ("python", "-m", "sglang.launch_server")),
                                            ("tgi", ("text-generation-launcher",))])
def test_single_node_serving_is_a_valid_deployment_and_service(engine, program):
    m = serving_8b()
    out = files(m, "kubernetes", options=ExportOptions(engine=engine))
    assert list(out) == ["deployment.yaml"]
    objs = k8s_objects(out["deployment.yaml"].text)
    assert [o["kind"] for o in objs] == ["Deployment", "Service"]
    for o in objs:
        k8s_validate(o)
    dep, svc = objs
    assert dep["apiVersion"] == "apps/v1" and svc["apiVersion"] == "v1"
    assert dep["spec"]["replicas"] == 4  # one pod per replica (dp)
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()  # the API server requires it
    assert svc["spec"]["selector"].items() <= labels.items()
    assert_pod_shape(dep["spec"]["template"], gpus=2)
    c = only_container(dep["spec"]["template"])
    assert c["ports"] == [{"containerPort": 8000, "name": "http"}]
    assert svc["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": 8000}]
    words = command_argv(c["args"][0], program)
    tp_flag = {"vllm": "--tensor-parallel-size", "sglang": "--tp-size", "tgi": "--num-shard"}[engine]
    assert words[words.index(tp_flag) + 1] == "2"
    assert words[words.index("--port") + 1] == "8000"


def test_every_kubernetes_export_of_the_grid_passes_kubernetes_validate():
    """Every Kubernetes file over the export test grid (each engine, PVC cache or not): core
    objects validated as they are, LeaderWorkerSet pod templates as PodTemplates."""
    from test_export import kubernetes_files

    checked = 0
    for opts in ({}, {"cache_pvc": "model-cache-rwx", "hf_token_secret": "hf-token"}):
        for label, text in kubernetes_files(**opts):
            for o in k8s_objects(text):
                if o["kind"] == "LeaderWorkerSet":
                    lwt = o["spec"]["leaderWorkerTemplate"]
                    for t in (lwt["leaderTemplate"], lwt["workerTemplate"]):
                        k8s_validate(as_pod_template(t))
                else:
                    k8s_validate(o)
                checked += 1
    assert checked >= 60, checked


def _check_lws(text: str, *, replicas: int, size: int, gpus: int) -> tuple[dict, dict, dict]:
    objs = k8s_objects(text)
    assert [o["kind"] for o in objs] == ["LeaderWorkerSet", "Service"]
    lws, svc = objs
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    k8s_validate(svc)
    lwt = lws["spec"]["leaderWorkerTemplate"]
    leader, worker = lwt["leaderTemplate"], lwt["workerTemplate"]
    k8s_validate(as_pod_template(leader))
    k8s_validate(as_pod_template(worker))
    assert lws["spec"]["replicas"] == replicas
    assert lwt["size"] == size
    for t in (leader, worker):
        assert_pod_shape(t, gpus=gpus)
    # the Service reaches the leaders only (they serve the API), on the leader's container port
    assert svc["spec"]["selector"].items() <= leader["metadata"]["labels"].items()
    assert not svc["spec"]["selector"].items() <= worker["metadata"]["labels"].items()
    port = only_container(leader)["ports"][0]["containerPort"]
    assert svc["spec"]["ports"][0]["targetPort"] == port == 8000
    return lws, leader, worker


def test_multi_node_serving_replica_is_a_leader_worker_set_with_valid_pod_templates():
    m = serving_405b()
    assert m.layout.dp == 1 and m.hardware.num_nodes == 2
    out = files(m, "kubernetes")
    assert list(out) == ["lws.yaml"]
    _, leader, worker = _check_lws(out["lws.yaml"].text, replicas=m.layout.dp, size=2, gpus=8)
    lead = only_container(leader)["args"][0]
    serve = command_argv(lead, ("vllm", "serve"))
    assert serve[serve.index("--tensor-parallel-size") + 1] == "8"
    assert serve[serve.index("--pipeline-parallel-size") + 1] == "2"
    assert serve[serve.index("--distributed-executor-backend") + 1] == "ray"
    join = command_argv(only_container(worker)["args"][0], ("ray", "start"))
    assert join[join.index("--address") + 1] == "$LWS_LEADER_ADDRESS:6379"  # LWS sets it in every pod


def test_vllm_export_of_multi_node_plan_carries_the_same_valid_leader_worker_set():
    m = serving_405b()
    out = files(m, "vllm")
    assert set(out) == {"ray-head.sh", "ray-worker.sh", "serve.sh", "lws.yaml"}
    _check_lws(out["lws.yaml"].text, replicas=m.layout.dp, size=2, gpus=8)
    assert k8s_objects(out["lws.yaml"].text) == k8s_objects(files(m, "kubernetes")["lws.yaml"].text)


def test_sglang_leader_worker_set_gives_each_pod_its_node_rank_from_lws():
    m = serving_405b()
    _, leader, worker = _check_lws(files(m, "kubernetes", options=ExportOptions(engine="sglang"))["lws.yaml"].text,
                                   replicas=m.layout.dp, size=2, gpus=8)
    assert only_container(leader)["image"].startswith("lmsysorg/sglang:")
    for t in (leader, worker):
        words = command_argv(only_container(t)["args"][0], ("python", "-m", "sglang.launch_server"))
        flags = dict(zip(words[::2], words[1::2]))
        assert flags["--tp-size"] == "8" and flags["--pp-size"] == "2" and flags["--nnodes"] == "2"
        assert flags["--node-rank"] == "$LWS_WORKER_INDEX"
        assert flags["--dist-init-addr"] == "$LWS_LEADER_ADDRESS:20000"


def test_multi_node_training_is_a_valid_indexed_job_with_headless_rendezvous_service():
    m = training_70b()
    out = files(m, "kubernetes")
    assert list(out) == ["job.yaml"]
    objs = k8s_objects(out["job.yaml"].text)
    kinds = [o["kind"] for o in objs]
    assert sorted(kinds) == ["ConfigMap", "Job", "Service"], kinds  # the plan travels in a ConfigMap
    for o in objs:
        k8s_validate(o)
    by_kind = {o["kind"]: o for o in objs}
    job, svc, plan_cm = by_kind["Job"], by_kind["Service"], by_kind["ConfigMap"]
    spec = job["spec"]
    assert spec["completions"] == spec["parallelism"] == 2
    assert spec["completionMode"] == "Indexed"
    pod = spec["template"]
    # a container whose torchrun gave up restarts in place (same pod, same DNS name), and the Job
    # fails after as many such restarts as torchrun's own (issue 28, item 4)
    assert pod["spec"]["restartPolicy"] == "OnFailure"
    assert_pod_shape(pod, gpus=8)
    c = only_container(pod)
    assert c["resources"]["limits"][GPU] == 8
    dshm = [v for v in pod["spec"]["volumes"] if v["name"] == "dshm"]
    assert dshm and dshm[0]["emptyDir"]["medium"] == "Memory"
    # pod i of an Indexed Job is <job>-i; with subdomain = the headless Service it resolves as <job>-0.<svc>
    assert svc["spec"]["clusterIP"] == "None"
    assert pod["spec"]["subdomain"] == svc["metadata"]["name"]
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    args = torchrun_args(command_argv(c["args"][0], ("torchrun",)))
    assert (args.nnodes, args.nproc_per_node, args.rdzv_backend) == ("2:2", "8", "c10d")
    assert spec["backoffLimit"] == args.max_restarts == 3
    launch, _, _ = elastic_config(args)
    assert (launch.min_nodes, launch.max_nodes, launch.max_restarts, launch.run_id) == (2, 2, 3, rdzv_id(m))
    assert "shardplan replan plan.yaml --nodes K --lost-nodes I,J --from-checkpoint DIR" in out["job.yaml"].text
    host, port = args.rdzv_endpoint.rsplit(":", 1)
    assert host == f"{job['metadata']['name']}-0.{svc['metadata']['name']}"
    assert svc["spec"]["ports"][0]["port"] == svc["spec"]["ports"][0]["targetPort"] == int(port) == 29500
    # `shardplan verify <plan>` reads the plan from the ConfigMap's mount: same plan, at that path
    assert (args.module, args.training_script, args.training_script_args[0]) == (True, "shardplan", "verify")
    plan_path = Path(args.training_script_args[1])
    (vol,) = [v for v in pod["spec"]["volumes"] if v.get("configMap", {}).get("name") == plan_cm["metadata"]["name"]]
    (mount,) = [mt for mt in c["volumeMounts"] if mt["name"] == vol["name"]]
    assert plan_path.parent == Path(mount["mountPath"]) and plan_path.name in plan_cm["data"]
    plan = yaml.safe_load(plan_cm["data"][plan_path.name])
    assert plan["model"]["name"] == "llama-3.1-70b"
    assert (plan["layout"]["tp"], plan["layout"]["pp"], plan["hardware"]["num_nodes"]) == (8, 2, 2)


# ----- 2. DeepSpeed -------------------------------------------------------------------------


class FakeMpu:
    """The parts of a model-parallel unit DeepSpeedConfig asks for."""

    def __init__(self, dp: int):
        self.dp = dp

    def get_data_parallel_world_size(self) -> int:
        return self.dp

    def get_data_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0


@pytest.fixture
def ds_config(monkeypatch):
    """Parse a ds_config.json text with DeepSpeed's own DeepSpeedConfig, for a plan's dp."""
    import deepspeed.runtime.config as dsc

    monkeypatch.setattr(dsc.dist, "get_rank", lambda *a, **k: 0)

    def parse(text: str, dp: int):
        cfg = dsc.DeepSpeedConfig(json.loads(text), mpu=FakeMpu(dp))
        assert cfg.world_size == dp  # the mpu was consulted, not the world-size-1 fallback
        return cfg

    return parse


@pytest.mark.parametrize("layout,stage,accum", [
    (dict(dp=8, zero_stage=3), 3, 64),
    (dict(dp=8, zero_stage=2, micro_batch_size=2), 2, 32),
    (dict(tp=2, dp=4, zero_stage=1), 1, 128),
    (dict(pp=2, dp=4, zero_stage=1), 1, 128),
])
def test_ds_config_parses_in_deepspeed_with_the_plans_batch_and_zero_stage(ds_config, layout, stage, accum):
    m = training("llama-3.1-8b", 8, **layout)
    cfg = ds_config(files(m, "deepspeed")["ds_config.json"].text, m.layout.dp)
    assert cfg.zero_optimization_stage == stage
    assert cfg.train_batch_size == m.workload.global_batch_size == 512
    assert cfg.train_micro_batch_size_per_gpu == m.layout.micro_batch_size
    assert cfg.gradient_accumulation_steps == accum == 512 // (m.layout.micro_batch_size * m.layout.dp)
    assert cfg.bfloat16_config.enabled is True
    assert cfg.optimizer_name == "adamw"
    assert cfg.zero_config.offload_optimizer is None and cfg.zero_config.offload_param is None
    if stage > 0:
        assert cfg.zero_config.overlap_comm is True
    if m.layout.tp > 1:
        assert cfg.tensor_parallel_config.autotp_size == m.layout.tp


def test_ds_config_bf16_master_weights_and_moments_are_read_by_deepspeed(ds_config):
    """--master-dtype bf16 --moment-dtype bf16 become DeepSpeed's bf16_master_weights_and_grads and
    bf16_optimizer_states (PR #7700), which its own config check accepts only together under ZeRO 1-3."""
    from shardplan.units import DType

    wl = TrainingWorkload(master_dtype=DType.BF16, moment_dtype=DType.BF16)
    m = fitting(build_plan("llama-3.1-8b", 8, Layout(dp=8, zero_stage=3), wl)[0])
    cfg = ds_config(files(m, "deepspeed")["ds_config.json"].text, 8)
    assert cfg.bfloat16_config.bf16_master_weights_and_grads is True
    assert cfg.bfloat16_config.bf16_optimizer_states is True
    plain = ds_config(files(training("llama-3.1-8b", 8, dp=8, zero_stage=3), "deepspeed")["ds_config.json"].text, 8)
    assert plain.bfloat16_config.bf16_master_weights_and_grads is False
    assert plain.bfloat16_config.bf16_optimizer_states is False


@pytest.mark.parametrize("where", [Offload.CPU, Offload.NVME])
def test_ds_config_offload_is_read_by_deepspeed(ds_config, where):
    m = training("llama-3.1-8b", 8, dp=8, zero_stage=3, offload_optimizer=where, offload_params=where)
    cfg = ds_config(files(m, "deepspeed", spec=spec_of("llama-3.1-8b"),
                          options=ExportOptions(nvme_path="/mnt/nvme0"))["ds_config.json"].text, 8)
    assert cfg.zero_optimization_stage == 3
    for part in (cfg.zero_config.offload_optimizer, cfg.zero_config.offload_param):
        assert part is not None
        assert part.device == where.value
        assert part.pin_memory is True
        if where is Offload.NVME:
            assert str(part.nvme_path) == "/mnt/nvme0"
        else:
            assert part.nvme_path is None


def _swapper_partition_numel(numel: int, dp: int) -> int:
    """The partition DeepSpeed's ZeRO-3 hands its NVMe swapper for a tensor of `numel` elements
    over `dp` ranks, computed by DeepSpeed's own Init._aligned_size / _partition_world_size
    (partition_parameters.py `_partition_param`: partition_size = aligned // world)."""
    from deepspeed.runtime.zero.partition_parameters import Init

    fake = types.SimpleNamespace(_partition_world_size=lambda p: dp)
    fake._padding_size = lambda p: Init._padding_size(fake, p)
    return Init._aligned_size(fake, types.SimpleNamespace(ds_numel=numel)) // dp


def _swapper_accepts(cfg, numel: int) -> bool:
    """AsyncPartitionedParameterSwapper.get_buffer's check, on DeepSpeed's parsed config:
    `assert numel <= self.elements_per_buffer` with elements_per_buffer = offload_param.buffer_size."""
    import inspect

    from deepspeed.runtime.swap_tensor.partitioned_param_swapper import AsyncPartitionedParameterSwapper

    src = inspect.getsource(AsyncPartitionedParameterSwapper.get_buffer)
    assert "assert numel <= self.elements_per_buffer" in src  # the rule this test reproduces is still DeepSpeed's
    return numel <= cfg.zero_config.offload_param.buffer_size


def test_nvme_parameter_offload_buffers_hold_a_70b_models_largest_tensor(ds_config):
    """A 70B model's embedding (128256 x 8192 = 1.05e9 elements) split over 8 ranks is 1.31e8
    elements per partition, above DeepSpeed's default buffer_size of 1e8: the export sizes the
    buffers so that DeepSpeed's swapper takes it, and sets the aio block DeepSpeed reads."""
    from shardplan.exporters.deepspeed import largest_tensor_numel

    spec = spec_of("llama-3.1-70b")
    m = training("llama-3.1-70b", 8, dp=8, zero_stage=3, offload_optimizer=Offload.NVME, offload_params=Offload.NVME,
                 recompute="full")
    assert largest_tensor_numel(spec) == 128256 * 8192
    part = _swapper_partition_numel(128256 * 8192, 8)
    assert part > 100_000_000  # DeepSpeed's default would assert "More elements ... than buffer size"
    default = ds_config(json.dumps({"train_batch_size": 512, "train_micro_batch_size_per_gpu": 1,
                                    "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme",
                                                                                          "nvme_path": "/x"}}}), 8)
    assert not _swapper_accepts(default, part)
    text = files(m, "deepspeed", spec=spec)["ds_config.json"].text
    cfg = ds_config(text, 8)
    assert _swapper_accepts(cfg, part)
    # every tensor of the model fits, the largest included
    assert cfg.zero_config.offload_param.buffer_count >= 5 and cfg.zero_config.offload_optimizer.buffer_count >= 4
    raw = json.loads(text)
    assert set(raw["aio"]) == {"block_size", "queue_depth", "intra_op_parallelism", "single_submit",
                               "overlap_events", "use_gds"}
    assert cfg.aio_config == raw["aio"]  # DeepSpeed read every key we wrote (get_aio_config)


def test_deepspeed_single_node_launch_line_parses_in_deepspeeds_runner():
    from deepspeed.launcher.runner import parse_args

    m = training("llama-3.1-8b", 8, dp=8, zero_stage=3)
    out = files(m, "deepspeed")
    assert set(out) == {"ds_config.json", "launch.sh"} and out["launch.sh"].executable
    args = parse_args(command_argv(out["launch.sh"].text, ("deepspeed",)))
    assert (args.num_nodes, args.num_gpus) == (1, 8)
    assert args.user_script == "train.py"
    assert args.user_args == ["--deepspeed", "--deepspeed_config", "ds_config.json"]
    assert "--hostfile" not in out["launch.sh"].text  # one node runs locally, without a hostfile


def test_deepspeed_two_node_launch_line_and_hostfile_parse_in_deepspeeds_runner(tmp_path):
    from deepspeed.launcher.runner import _parse_hostfile, parse_args

    m = training_8b_two_nodes()
    out = files(m, "deepspeed")
    assert set(out) == {"ds_config.json", "launch.sh", "hostfile"}
    text = out["launch.sh"].text
    args = parse_args(command_argv(text, ("deepspeed",)))
    assert (args.num_nodes, args.num_gpus, args.master_port) == (2, 8, 29500)
    assert args.hostfile == "hostfile" and args.master_addr == "$HEAD_ADDR"
    assert args.user_args[-2:] == ["--deepspeed_config", "ds_config.json"]
    pool = _parse_hostfile(out["hostfile"].text.splitlines())
    assert list(pool.values()) == [8, 8]
    assert len(pool) == args.num_nodes and sum(pool.values()) == m.hardware.num_gpus
    # as bash runs it, HEAD_ADDR reaches the launcher as the master address
    real = parse_args(shell_argv(text, tmp_path, {"HEAD_ADDR": "10.0.0.1"}))
    assert real.master_addr == "10.0.0.1" and real.num_nodes == 2


# ----- 3. accelerate device_map (big-model inference) --------------------------------------


@pytest.fixture(scope="module")
def debug_checkpoint(tmp_path_factory):
    """The debug spec as a transformers Llama: a seeded model, its safetensors checkpoint, and
    its logits on fixed tokens."""
    import torch
    import transformers

    spec = spec_of("debug")
    config = transformers.LlamaConfig(
        vocab_size=1024, hidden_size=256, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
        head_dim=32, intermediate_size=512, tie_word_embeddings=False, max_position_embeddings=512,
        rope_theta=10000.0)
    assert spec.model_type == "llama"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    ckpt = tmp_path_factory.mktemp("debug-ckpt")
    model.save_pretrained(ckpt, safe_serialization=True)
    assert (ckpt / "model.safetensors").is_file()
    ids = torch.randint(0, 1024, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids).logits
    return types.SimpleNamespace(config=config, path=ckpt, ids=ids, logits=logits)


def _empty_model(config):
    import accelerate
    import transformers

    with accelerate.init_empty_weights():
        return transformers.LlamaForCausalLM(config)


def _dispatch_and_compare(ck, device_map: dict, no_split: list[str], offload_folder: Path | None = None):
    import accelerate
    import torch

    model = accelerate.load_checkpoint_and_dispatch(
        _empty_model(ck.config), str(ck.path), device_map=device_map, no_split_module_classes=no_split,
        offload_folder=None if offload_folder is None else str(offload_folder))
    model.eval()
    with torch.no_grad():
        logits = model(ck.ids).logits
    assert logits.shape == (2, 24, 1024)
    assert torch.allclose(logits, ck.logits, atol=1e-5), (logits - ck.logits).abs().max()
    return model


def _gpus_to_cpu(device_map: dict) -> dict:
    return {k: "cpu" if isinstance(v, int) else v for k, v in device_map.items()}


def _export_device_map(m) -> dict:
    out = files(m, "accelerate", spec=spec_of("debug"))
    assert set(out) == {"device_map.json", "README.txt"}
    doc = json.loads(out["device_map.json"].text)
    assert set(doc) == {"device_map", "no_split_module_classes"}
    return doc


def test_device_map_puts_each_pipeline_stage_on_its_gpu_and_loads_in_accelerate(debug_checkpoint):
    from accelerate.utils.modeling import check_device_map

    m = serving_debug_pp2()
    doc = _export_device_map(m)
    dmap = doc["device_map"]
    expected = {"model.embed_tokens": 0, "model.rotary_emb": 0,
                **{f"model.layers.{i}": 0 if i < 4 else 1 for i in range(8)},
                "model.norm": 1, "lm_head": 1}
    assert dmap == expected
    assert all(type(v) is int for v in dmap.values())
    empty = _empty_model(debug_checkpoint.config)
    modules = dict(empty.named_modules())
    assert set(dmap) <= set(modules)  # every key names a module of transformers' LlamaForCausalLM
    assert doc["no_split_module_classes"] == [type(empty.model.layers[0]).__name__] == ["LlamaDecoderLayer"]
    check_device_map(empty, dmap)  # accelerate: every parameter is placed
    model = _dispatch_and_compare(debug_checkpoint, _gpus_to_cpu(dmap), doc["no_split_module_classes"])
    assert {p.device.type for p in model.parameters()} == {"cpu"}


@pytest.mark.parametrize("where,placed", [("nvme", "disk"), ("cpu", "cpu")])
def test_device_map_with_parameter_offload_loads_in_accelerate(debug_checkpoint, tmp_path, where, placed):
    from accelerate.utils.modeling import check_device_map

    base = serving_debug_pp2()
    m = base.model_copy(update={"layout": base.layout.model_copy(update={"offload_params": where})})
    doc = _export_device_map(m)
    dmap = doc["device_map"]
    assert {k: v for k, v in dmap.items() if k.startswith("model.layers.")} == {
        f"model.layers.{i}": placed for i in range(8)}
    assert dmap["model.embed_tokens"] == 0 and dmap["model.norm"] == 1 and dmap["lm_head"] == 1
    check_device_map(_empty_model(debug_checkpoint.config), dmap)
    offload = tmp_path / "offload"
    model = _dispatch_and_compare(debug_checkpoint, _gpus_to_cpu(dmap), doc["no_split_module_classes"],
                                  offload_folder=offload)
    if placed == "disk":  # the blocks' weights really live in the offload folder, not in memory
        assert model.model.layers[0].self_attn.q_proj.weight.device.type == "meta"
        assert all((offload / f"model.layers.{i}.mlp.down_proj.weight.dat").is_file() for i in range(8))
        assert model.lm_head.weight.device.type == "cpu"
    else:
        assert {p.device.type for p in model.parameters()} == {"cpu"}
        assert not offload.exists() or not any(offload.iterdir())


# ----- 4. accelerate FSDP config -------------------------------------------------------------


def _fsdp_export(m, model: str = "llama-3.1-8b") -> dict[str, ExportFile]:
    out = files(m, "accelerate", spec=spec_of(model))
    assert set(out) == {"accelerate_fsdp.yaml", "launch.sh"}
    return out


@pytest.mark.parametrize("zero_stage,reshard", [(3, True), (2, False)])
def test_fsdp_config_loads_in_accelerates_cluster_config(tmp_path, zero_stage, reshard):
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.utils import DistributedType

    m = training("llama-3.1-8b", 8, dp=8, zero_stage=zero_stage)
    path = tmp_path / "accelerate_fsdp.yaml"
    path.write_text(_fsdp_export(m)["accelerate_fsdp.yaml"].text)
    cfg = ClusterConfig.from_yaml_file(path)  # raises on keys accelerate does not know
    assert cfg.distributed_type == DistributedType.FSDP
    assert (cfg.num_processes, cfg.num_machines, cfg.machine_rank) == (8, 1, 0)
    assert cfg.mixed_precision == "bf16"
    assert cfg.fsdp_config["fsdp_version"] == 2
    assert cfg.fsdp_config["fsdp_reshard_after_forward"] is reshard
    assert cfg.fsdp_config["fsdp_transformer_layer_cls_to_wrap"] == "LlamaDecoderLayer"
    assert cfg.fsdp_config["fsdp_offload_params"] is False


def _accelerate_launch(argv: list[str]):
    """What `accelerate launch` makes of the line, step by step as its FSDP path runs
    (launch_command -> multi_gpu_launcher): its parser, config merging and checks, the
    environment it starts the ranks with (only the variables it adds), and the torch elastic
    LaunchConfig and rank command it hands torch.distributed.run."""
    import torch.distributed.run as distrib_run
    from accelerate.commands.launch import _filter_args, _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = launch_command_parser().parse_args(argv)
    args, _, _ = _validate_launch_command(args)
    env = prepare_multi_gpu_env(args)
    torch_args = _filter_args(args, distrib_run.get_args_parser(),
                              ["--training_script", args.training_script,
                               "--training_script_args", args.training_script_args])
    launch, _, rank_argv = elastic_config(torch_args)
    added = {k: v for k, v in env.items() if os.environ.get(k) != v}
    return types.SimpleNamespace(args=args, env=added, launch=launch, rank_argv=rank_argv)


def _check_rank_side(env: dict[str, str], world: int, cls: str):
    """The objects a rank builds from that environment: accelerate's FSDP plugin and its
    ParallelismConfig, checked the way Accelerator() checks it (an FSDP2 run of `world` processes)."""
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, patch_environment

    with patch_environment(**env):
        plugin = FullyShardedDataParallelPlugin()
        pc = ParallelismConfig() if env.get("ACCELERATE_USE_PARALLELISM_CONFIG") == "true" else None
    assert plugin.transformer_cls_names_to_wrap == [cls]
    if pc is not None:
        pc._validate_accelerator(types.SimpleNamespace(
            multi_device=False, is_fsdp2=True, num_processes=world, distributed_type=DistributedType.FSDP,
            is_main_process=True))
        assert pc.total_size == world
    return plugin, pc


@pytest.mark.parametrize("model,layout,reshard", [
    ("llama-3.1-8b", dict(dp=8, zero_stage=3), True),
    ("llama-3.1-8b", dict(dp=8, zero_stage=2), False),
    ("llama-3.1-8b", dict(tp=2, dp=4, zero_stage=3), True),
], ids=["zero3", "zero2", "tp2-zero3"])
def test_accelerate_launch_line_runs_the_fsdp_config_through_accelerates_launcher(
        tmp_path, monkeypatch, model, layout, reshard):
    m = training(model, 8, **layout)
    out = _fsdp_export(m, model)
    (tmp_path / "accelerate_fsdp.yaml").write_text(out["accelerate_fsdp.yaml"].text)
    monkeypatch.chdir(tmp_path)
    argv = command_argv(out["launch.sh"].text, ("accelerate", "launch"))
    run = _accelerate_launch(argv)
    args, env = run.args, run.env
    assert args.config_file == "accelerate_fsdp.yaml" and args.training_script == "train.py"
    assert args.use_fsdp is True and args.num_processes == 8
    assert args.nproc_per_node == "8"
    assert (run.launch.min_nodes, run.launch.max_nodes, run.launch.nproc_per_node) == (1, 1, 8)
    assert run.rank_argv == ["-u", "train.py"]
    assert env["ACCELERATE_USE_FSDP"] == "true" and env["FSDP_VERSION"] == "2"
    assert env["FSDP_RESHARD_AFTER_FORWARD"] == str(reshard).lower()
    assert env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    plugin, pc = _check_rank_side(env, 8, "LlamaDecoderLayer")
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is reshard
    assert pc is not None and pc.tp_size == m.layout.tp
    assert pc.dp_replicate_size * pc.dp_shard_size == m.layout.dp


def test_accelerate_zero0_plan_launches_plain_data_parallel(tmp_path, monkeypatch):
    # FSDP needs something to shard (accelerate 1.15 refuses dp_shard_size = cp_size = 1), so a
    # ZeRO-0 plan is exported as DDP
    m = training("llama-3.2-1b", 8, dp=8, zero_stage=0)
    out = _fsdp_export(m, "llama-3.2-1b")
    (tmp_path / "accelerate_fsdp.yaml").write_text(out["accelerate_fsdp.yaml"].text)
    monkeypatch.chdir(tmp_path)
    run = _accelerate_launch(command_argv(out["launch.sh"].text, ("accelerate", "launch")))
    assert run.args.multi_gpu is True and run.args.use_fsdp is False and run.args.num_processes == 8
    assert run.env.get("ACCELERATE_USE_FSDP", "false") == "false"
    assert (run.launch.min_nodes, run.launch.nproc_per_node) == (1, 8)


def test_accelerate_two_node_launch_reaches_torchrun_with_the_nodes_rank_and_head(tmp_path, monkeypatch):
    from accelerate.commands.config.config_args import ClusterConfig

    m = training_8b_two_nodes()
    out = _fsdp_export(m)
    (tmp_path / "accelerate_fsdp.yaml").write_text(out["accelerate_fsdp.yaml"].text)
    cfg = ClusterConfig.from_yaml_file(tmp_path / "accelerate_fsdp.yaml")
    assert (cfg.num_machines, cfg.num_processes) == (2, 16)
    literal = command_argv(out["launch.sh"].text, ("accelerate", "launch"))
    assert literal[literal.index("--machine_rank") + 1] == "$NODE_RANK"  # an int only once bash expands it
    # as bash runs it on node 1: accelerate's parser, config merging and torchrun arguments
    argv = shell_argv(out["launch.sh"].text, tmp_path, {"HEAD_ADDR": "10.0.0.1", "NODE_RANK": "1"})
    monkeypatch.chdir(tmp_path)
    run = _accelerate_launch(argv)
    assert (run.args.nnodes, run.args.nproc_per_node, run.args.node_rank) == ("2", "8", 1)
    launch = run.launch  # what torch elastic is started with on node 1
    assert (launch.min_nodes, launch.max_nodes, launch.nproc_per_node) == (2, 2, 8)
    assert launch.rdzv_backend == "static" and launch.rdzv_configs["rank"] == 1
    assert launch.rdzv_endpoint == "10.0.0.1:29500"
    assert run.rank_argv == ["-u", "train.py"]
    _, pc = _check_rank_side(run.env, 16, "LlamaDecoderLayer")
    assert pc.dp_shard_size * pc.dp_replicate_size == 16


# ----- 5. torchrun and Slurm -----------------------------------------------------------------


def test_single_node_torchrun_line_parses_in_torch_as_standalone_shardplan_verify():
    m = training("llama-3.1-8b", 8, dp=8, zero_stage=3)
    out = files(m, "torchrun")
    assert list(out) == ["torchrun.sh"] and out["torchrun.sh"].executable
    args = torchrun_args(command_argv(out["torchrun.sh"].text, ("torchrun",)))
    assert args.standalone is True and args.nproc_per_node == "8" and args.max_restarts == 3
    assert args.nnodes == "1:1"  # torch's default; --standalone makes it one node
    assert args.rdzv_backend == "static"  # --standalone switches it to c10d at launch
    assert args.module is True and args.no_python is False
    assert (args.training_script, args.training_script_args) == ("shardplan", ["verify", "plan.yaml"])


def test_two_node_torchrun_line_parses_in_torch_with_c10d_rendezvous(tmp_path):
    m = training_70b()
    text = files(m, "torchrun")["torchrun.sh"].text
    args = torchrun_args(command_argv(text, ("torchrun",)))
    assert (args.nnodes, args.nproc_per_node, args.rdzv_backend, args.max_restarts) == ("2:2", "8", "c10d", 3)
    assert args.standalone is False
    assert args.module is True and args.training_script == "shardplan"
    assert args.training_script_args == ["verify", "plan.yaml"]
    real = torchrun_args(shell_argv(text, tmp_path, {"HEAD_ADDR": "10.0.0.1"}))
    assert (real.rdzv_endpoint, real.rdzv_id) == ("10.0.0.1:29500", rdzv_id(m))
    launch, _, rank_argv = elastic_config(real)
    assert (launch.min_nodes, launch.max_nodes, launch.nproc_per_node, launch.max_restarts) == (2, 2, 8, 3)
    assert (launch.rdzv_backend, launch.rdzv_endpoint, launch.run_id) == ("c10d", "10.0.0.1:29500", rdzv_id(m))
    assert rank_argv == ["-u", "-m", "shardplan", "verify", "plan.yaml"]
    assert launch.min_nodes * launch.nproc_per_node == m.hardware.num_gpus == 8 * 2 * 1  # tp * pp * dp


@pytest.mark.parametrize("script,module,no_python,program,rest", [
    ("train.py --lr 3e-4", False, False, "train.py", ["--lr", "3e-4"]),
    ("my-trainer --steps 10", False, True, "my-trainer", ["--steps", "10"]),
])
def test_torchrun_runs_the_given_script_as_torch_reads_it(script, module, no_python, program, rest):
    m = training("llama-3.1-8b", 8, dp=8, zero_stage=3)
    text = files(m, "torchrun", options=ExportOptions(script=script))["torchrun.sh"].text
    args = torchrun_args(command_argv(text, ("torchrun",)))
    assert (args.module, args.no_python) == (module, no_python)
    # the script's own arguments, then the plan's layout (issue 26: --script receives the degrees)
    assert args.training_script == program and args.training_script_args[:len(rest)] == rest
    layout = args.training_script_args[len(rest):]
    assert dict(zip(layout[::2], layout[1::2])) == {
        "--tp": "1", "--pp": "1", "--dp": "8", "--cp": "1", "--ep": "1", "--vp": "1", "--zero-stage": "3",
        "--micro-batch-size": "1", "--global-batch-size": str(m.workload.global_batch_size),
        "--seq-len": str(m.workload.seq_len)}


def _sbatch_directives(text: str) -> list[str]:
    """#SBATCH options as sbatch reads them: only before the first command line of the script."""
    out = []
    for line in text.splitlines()[1:]:
        s = line.strip()
        if s and not s.startswith("#"):
            break
        if s.startswith("#SBATCH"):
            out.append(s[len("#SBATCH"):].strip())
    return out


def test_two_node_slurm_script_requests_the_nodes_and_runs_torchrun_per_node(tmp_path):
    m = training_70b()
    out = files(m, "slurm")
    assert list(out) == ["slurm.sbatch"]
    text = out["slurm.sbatch"].text
    assert text.startswith("#!/usr/bin/env bash\n")
    directives = _sbatch_directives(text)
    assert "--nodes=2" in directives and "--gpus-per-node=8" in directives
    assert "--ntasks-per-node=1" in directives  # one torchrun per node
    assert text.count("#SBATCH") == len(directives)  # none sits where sbatch stops reading
    words = command_argv(text, ("srun",))
    assert "--kill-on-bad-exit=1" in words
    args = torchrun_args(words[words.index("torchrun") + 1:])
    assert (args.nnodes, args.nproc_per_node, args.rdzv_backend) == ("2:$SLURM_NNODES", "8", "c10d")
    assert "--requeue" in directives and "--signal=TERM@120" in directives
    assert args.module is True and args.training_script == "shardplan"
    # as Slurm runs it: SLURM_NNODES=2, the head is the allocation's first host
    real = torchrun_args(shell_argv(text, tmp_path, {"SLURM_NNODES": "2", "SLURM_JOB_ID": "4242",
                                                     "SLURM_JOB_NODELIST": "gpu[01-02]"}))
    assert (real.nnodes, real.nproc_per_node, real.rdzv_backend) == ("2:2", "8", "c10d")
    assert (real.rdzv_endpoint, real.rdzv_id) == ("gpu01:29500", f"{rdzv_id(m)}-4242")
    launch, _, _ = elastic_config(real)
    assert (launch.min_nodes, launch.max_nodes, launch.nproc_per_node, launch.max_restarts) == (2, 2, 8, 3)
    assert launch.run_id == f"{rdzv_id(m)}-4242"


# torchrun that fails (its restarts spent) and scontrol that records a requeue.
_FAILING = r"""
torchrun() { return 1; }
srun() { while [ "${1#-}" != "$1" ]; do shift; done; "$@"; }
scontrol() { case "$*" in "show hostnames $SLURM_JOB_NODELIST") printf 'gpu01\ngpu02\n';;
             "requeue $SLURM_JOB_ID") echo requeued >> "$CAPTURE";; *) exit 98;; esac; }
"""


@pytest.mark.parametrize("restart_count,requeued", [("0", True), ("2", True), ("3", False)])
def test_slurm_wrapper_requeues_a_failed_job_until_its_requeues_are_spent(tmp_path, restart_count, requeued):
    """bash runs the exported script with torchrun failing: it requeues the job (scontrol requeue)
    while SLURM_RESTART_COUNT < --max-restarts (3), and exits with torchrun's status either way."""
    text = files(training_70b(), "slurm")["slurm.sbatch"].text
    script, capture = tmp_path / "slurm.sbatch", tmp_path / "requeues"
    script.write_text(text)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "CAPTURE": str(capture), "SLURM_NNODES": "2",
           "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_RESTART_COUNT": restart_count}
    proc = subprocess.run(["bash", "-c", _FAILING + '\nsource "$1"', "bash", str(script)], env=env,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1, proc.stderr
    assert (capture.read_text() if capture.exists() else "") == ("requeued\n" if requeued else "")


def test_slurm_wrapper_reads_the_head_node_of_a_long_node_list(tmp_path):
    """A node list longer than a pipe's buffer: the script takes the first name without ending the
    hostname listing early (`head -n 1` would, and under `set -o pipefail` scontrol's SIGPIPE, 141,
    ended the job before torchrun ran, at random on short lists)."""
    text = files(training_70b(), "slurm")["slurm.sbatch"].text
    script, capture = tmp_path / "slurm.sbatch", tmp_path / "head"
    script.write_text(text)
    many = _FAILING.replace("printf 'gpu01\\ngpu02\\n'", "seq -f 'gpu%06g' 1 200000")
    assert many != _FAILING
    # torchrun records the rendezvous endpoint it was given, then fails as before
    many = many.replace("torchrun() { return 1; }",
                        'torchrun() { printf "%s\\n" "$@" | grep -A1 -e --rdzv-endpoint | tail -1 > "$CAPTURE"; return 1; }')
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "CAPTURE": str(capture), "SLURM_NNODES": "2",
           "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[000001-200000]", "SLURM_RESTART_COUNT": "3"}
    proc = subprocess.run(["bash", "-c", many + '\nsource "$1"', "bash", str(script)], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    assert capture.read_text().startswith("gpu000001:")


def test_elastic_two_node_torchrun_line_parses_in_torch_with_min_max_nodes(tmp_path):
    m = training_70b()
    text = files(m, "torchrun", options=ExportOptions(elastic_min_nodes=1, max_restarts=5))["torchrun.sh"].text
    launch, _, _ = elastic_config(torchrun_args(shell_argv(text, tmp_path, {"HEAD_ADDR": "10.0.0.1"})))
    assert (launch.min_nodes, launch.max_nodes, launch.max_restarts) == (1, 2, 5)


def test_single_node_slurm_script_runs_standalone_torchrun():
    m = training("llama-3.1-8b", 8, dp=8, zero_stage=3)
    text = files(m, "slurm")["slurm.sbatch"].text
    directives = _sbatch_directives(text)
    assert "--nodes=1" in directives and "--gpus-per-node=8" in directives
    words = command_argv(text, ("srun",))
    args = torchrun_args(words[words.index("torchrun") + 1:])
    assert args.standalone is True and args.nproc_per_node == "8"


@pytest.mark.parametrize("plan,target,kw", [
    (serving_8b, "vllm", {}),
    (serving_8b, "sglang", {}),
    (serving_8b, "tgi", {}),
    (serving_405b, "vllm", {}),
    (serving_405b, "sglang", {}),
    (lambda: training("llama-3.1-8b", 8, dp=8, zero_stage=3, offload_optimizer=Offload.NVME,
                      offload_params=Offload.NVME), "deepspeed", {"spec": spec_of("llama-3.1-8b")}),
    (training_8b_two_nodes, "deepspeed", {}),
    (lambda: training("llama-3.1-8b", 8, dp=8, zero_stage=3), "accelerate", {"spec": spec_of("llama-3.1-8b")}),
    (training_8b_two_nodes, "accelerate", {"spec": spec_of("llama-3.1-8b")}),
    (lambda: training("llama-3.1-8b", 8, dp=8, zero_stage=3), "torchrun", {}),
    (training_70b, "torchrun", {}),
    (lambda: training("llama-3.1-8b", 8, dp=8, zero_stage=3), "slurm", {}),
    (training_70b, "slurm", {}),
], ids=["vllm-1node", "sglang-1node", "tgi-1node", "vllm-2node", "sglang-2node", "deepspeed-nvme",
        "deepspeed-2node", "accelerate-1node", "accelerate-2node", "torchrun-1node", "torchrun-2node",
        "slurm-1node", "slurm-2node"])
def test_every_exported_script_passes_bash_syntax_check(plan, target, kw):
    scripts = [f for f in export(plan(), target, **kw) if f.name.endswith((".sh", ".sbatch"))]
    assert scripts, f"{target} exported no script"
    for f in scripts:
        assert f.executable, f.name
        assert f.text.startswith("#!/usr/bin/env bash\n"), f.name
        bash_syntax_ok(f.text)


@pytest.mark.parametrize("stage,copies", [(2, 2), (3, 1)])
def test_ds_config_reduce_bucket_is_the_one_the_plan_counted(ds_config, stage, copies):
    """A --stack deepspeed plan counts DeepSpeed's contiguous gradient bucket (two at stage 2 with
    overlap_comm, one at stage 3) and its ds_config.json sets the same reduce_bucket_size, which
    DeepSpeed's own config reads back."""
    from shardplan.cost.inputs import training_workload
    from shardplan.knowledge.load import stack_rules

    spec = spec_of("llama-3.1-8b")
    wl = training_workload(seq_len=4096, global_batch_size=512, optimizer="adamw", framework=None, flash_attention=None,
                           dropout=False, stack=stack_rules("deepspeed"), spec=spec, reduce_bucket_size="2e8")
    plan, report = build_plan("llama-3.1-8b", 8, Layout(dp=8, zero_stage=stage, recompute=Recompute.FULL), wl)
    m = fitting(plan)
    rank = report["memory"]["per_rank"][0]
    assert rank["detail_bytes"]["temporary.zero_reduce_buckets"] == copies * 200_000_000 * 2
    cfg = ds_config(files(m, "deepspeed")["ds_config.json"].text, 8)
    assert cfg.zero_config.reduce_bucket_size == 200_000_000
    assert cfg.zero_config.overlap_comm is True and cfg.zero_config.contiguous_gradients is True
