"""Hostile values cannot change what an export runs.

A plan file may be anyone's, and `--model-path`, `--script`, `--image` are pasted by people:
a model name or id such as `x; touch PWNED`, `$(touch PWNED)` or one with a line break must end
up as one argument or one YAML string, never as a command, a YAML key or a Python statement.

Proof, for every target and every plan shape its golden files cover: each shell script is run by
bash with every program it starts (vllm, torchrun, srun, ...) replaced by a stub that records its
argv, in a folder where `touch PWNED` would leave a file; each YAML file is read back with
yaml.safe_load_all and the shell commands inside it are run the same way; JSON with json.loads;
the JAX module with ast.parse. Values that cannot be placed safely are refused with exit 2.
"""

from __future__ import annotations

import ast
import json
import re
import stat
import subprocess
import sys

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib
from pathlib import Path

import pytest
import yaml
from test_export import GOLDEN, any_plan

from shardplan.errors import ShardplanError
from shardplan.exporters import ExportOptions, export
from shardplan.exporters.base import argv
from shardplan.plan.manifest import write_manifest
from shardplan.specs.loading import load_model

# A model name may hold anything: it reaches comments, job names and k8s object names.
HOSTILE_NAME = "evil\ntouch PWNED\r\n$(touch PWNED) `touch PWNED` ';touch PWNED;' \"\u2028key: [x]\x85- y\x1b[2J"
# An id or path holds no control characters (those are refused) but every shell metacharacter.
HOSTILE_WORD = "org/m; touch PWNED && $(touch PWNED) `touch PWNED` 'q' \"dq\" | tee PWNED > PWNED # *"
HOSTILE_SCRIPT = "train.py --name 'a; touch PWNED' \"$(touch PWNED)\" --out '`touch PWNED`'"
SCRIPT_WORDS = ["train.py", "--name", "a; touch PWNED", "$(touch PWNED)", "--out", "`touch PWNED`"]
PROGRAMS = ["vllm", "ray", "python", "text-generation-launcher", "trtllm-serve", "trtllm-build", "torchrun",
            "srun", "scontrol", "deepspeed", "accelerate", "llama-server"]
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
CASES = [(t, n) for t, names in GOLDEN.items() for n in names]


def hostile_plan(name: str, *, hf_id: str | None):
    m = any_plan(name)
    return m.model_copy(update={"model": m.model.model_copy(update={"name": HOSTILE_NAME, "hf_id": hf_id})}), m.model.name


@pytest.fixture(scope="module")
def stubs(tmp_path_factory) -> Path:
    """A folder of programs that append their argv (as JSON) to $STUB_LOG and succeed."""
    folder = tmp_path_factory.mktemp("stubs")
    for prog in PROGRAMS:
        p = folder / prog
        p.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                     "with open(os.environ['STUB_LOG'], 'a') as f:\n"
                     "    f.write(json.dumps([os.path.basename(sys.argv[0]), *sys.argv[1:]]) + '\\n')\n")
        p.chmod(p.stat().st_mode | stat.S_IXUSR)
    return folder


def run_shell(code: str, stubs: Path, cwd: Path, *, as_file: bool) -> list[list[str]]:
    """Run a script (or a `bash -c` string) with the stubs first on PATH; return what the stubs saw."""
    log = cwd / "argv.log"
    env = {"PATH": f"{stubs}:/usr/bin:/bin", "STUB_LOG": str(log), "HEAD_ADDR": "10.0.0.1", "NODE_RANK": "0",
           "LWS_LEADER_ADDRESS": "10.0.0.1", "LWS_WORKER_INDEX": "0", "SLURM_JOB_NODELIST": "n[0-1]",
           "SLURM_NNODES": "2", "SLURM_JOB_ID": "7", "HOME": str(cwd)}
    if as_file:
        path = cwd / "script.sh"
        path.write_text(code)
        cmd = ["bash", str(path)]
        syntax = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert syntax.returncode == 0, syntax.stderr
    else:
        cmd = ["bash", "-c", code]
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, (r.stderr, code)
    assert not (cwd / "PWNED").exists(), f"a hostile value ran a command:\n{code}"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def check_files(files, stubs: Path, tmp_path: Path) -> list[list[str]]:
    """Run or parse every exported file; return every argv the scripts started."""
    seen: list[list[str]] = []
    for f in files:
        work = tmp_path / f"run-{f.name}"
        work.mkdir()
        if f.name.endswith((".sh", ".sbatch")):
            seen += run_shell(f.text, stubs, work, as_file=True)
        elif f.name.endswith(".yaml"):
            docs = [d for d in yaml.safe_load_all(f.text) if d is not None]
            assert docs and all(isinstance(d, dict) for d in docs), f.name
            for d in docs:
                if "kind" in d:  # a Kubernetes object: only the keys an object has at the top
                    assert set(d) <= {"apiVersion", "kind", "metadata", "spec", "data"}, (f.name, set(d))
                    assert DNS_LABEL.fullmatch(d["metadata"]["name"].removesuffix("-plan")), d["metadata"]["name"]
                for shell in _pod_shells(d):
                    seen += run_shell(shell, stubs, work, as_file=False)
        elif f.name.endswith(".toml"):
            assert isinstance(tomllib.loads(f.text), dict)  # a name cannot end a string or add a key
        elif f.name.endswith(".json"):
            assert isinstance(json.loads(f.text), dict)
        elif f.name.endswith(".py"):
            kinds = [type(n).__name__ for n in ast.parse(f.text).body]
            assert set(kinds) <= {"ImportFrom", "Assign", "FunctionDef"}, kinds  # no statement came from a name
        elif f.name not in ("hostfile", "README.txt"):
            raise AssertionError(f"no check for {f.name}")
    return seen


def _pod_shells(obj) -> list[str]:
    if isinstance(obj, dict):
        if obj.get("command") == ["/bin/bash", "-c"]:
            return list(obj["args"])
        return [s for v in obj.values() for s in _pod_shells(v)]
    if isinstance(obj, list):
        return [s for v in obj for s in _pod_shells(v)]
    return []


def _export(target: str, name: str, m, model: str, **opts):
    return export(m, target, spec=load_model(model).spec, options=ExportOptions(plan_file="plan.yaml", **opts))


@pytest.mark.parametrize("target,name", CASES)
def test_hostile_names_and_ids_stay_one_argument(target, name, stubs, tmp_path):
    m, model = hostile_plan(name, hf_id=HOSTILE_WORD)
    training = m.workload.kind == "training"
    opts = {"script": HOSTILE_SCRIPT} if training else {}
    seen = check_files(_export(target, name, m, model, **opts), stubs, tmp_path)
    words = [w for av in seen for w in av]
    if target in ("vllm", "sglang", "tgi", "trtllm") or (target == "kubernetes" and not training):
        assert HOSTILE_WORD in words  # the engine got the id as one word
    if training and target != "jax":
        k = len(SCRIPT_WORDS)  # the script, word for word (DeepSpeed appends its own flags after it)
        assert any(av[i:i + k] == SCRIPT_WORDS for av in seen for i in range(len(av))), seen
    assert not any(HOSTILE_NAME in w or "PWNED\n" in w for w in words)
    if target == "kubernetes" and training:  # the plan rides along in a ConfigMap, byte for byte
        cm = next(yaml.safe_load_all(_export(target, name, m, model)[0].text))  # no --script: ranks verify the plan
        assert cm["kind"] == "ConfigMap" and yaml.safe_load(cm["data"]["plan.yaml"])["model"]["name"] == HOSTILE_NAME


@pytest.mark.parametrize("target,name", [c for c in CASES if c[1].startswith("serve")
                                         and c[0] in ("vllm", "sglang", "tgi", "trtllm", "kubernetes")])
def test_hostile_model_path_stays_one_argument(target, name, stubs, tmp_path):
    m, model = hostile_plan(name, hf_id=None)
    try:
        files = _export(target, name, m, model, model_path=HOSTILE_WORD)
    except ShardplanError as e:  # a target that cannot express the plan says so before the path matters
        assert "cannot express" in e.message, e.message
        return
    seen = check_files(files, stubs, tmp_path)
    assert sum(av.count(HOSTILE_WORD) for av in seen) >= 1


def test_rendered_commands_split_back_into_the_same_words():
    m, model = hostile_plan("serve-1node", hf_id=HOSTILE_WORD)
    text = _export("vllm", "serve-1node", m, model)[0].text
    cmd = text[text.index("vllm serve"):]
    words = argv(cmd)
    assert words[:3] == ["vllm", "serve", HOSTILE_WORD]
    m, model = hostile_plan("train-2node", hf_id=None)
    text = _export("torchrun", "train-2node", m, model, script=HOSTILE_SCRIPT)[0].text
    words = argv(text[text.index("torchrun \\\n"):])  # the command, not a header comment that names torchrun
    i = words.index(SCRIPT_WORDS[0])
    assert words[i:i + len(SCRIPT_WORDS)] == SCRIPT_WORDS and words[i + len(SCRIPT_WORDS)] == "--tp"


def test_comments_hold_the_name_on_one_line():
    for target, name in (("torchrun", "train-2node"), ("slurm", "train-2node"), ("deepspeed", "train-2node-zero")):
        m, model = hostile_plan(name, hf_id=None)  # (YAML and Python files: parsed back in the test above)
        for f in _export(target, name, m, model):
            for line in f.text.splitlines():
                assert "touch PWNED" not in line or line.startswith("#"), (target, line)
    m, model = hostile_plan("train-2node", hf_id=None)
    sbatch = _export("slurm", "train-2node", m, model)[0].text
    job = next(line for line in sbatch.splitlines() if line.startswith("#SBATCH --job-name="))
    assert re.fullmatch(r"#SBATCH --job-name=shardplan-[A-Za-z0-9._-]+", job), job


@pytest.mark.parametrize("hf_id", ["--trust-remote-code", "-x", "org/m\nrm -rf ~", "  ", "a\x00b"])
def test_an_id_that_would_read_as_a_flag_or_break_the_line_is_refused(hf_id):
    m, model = hostile_plan("serve-1gpu", hf_id=hf_id)
    with pytest.raises(ShardplanError) as e:
        _export("vllm", "serve-1gpu", m, model)
    assert e.value.field == "model.hf_id" and "cannot be placed in a command line" in e.value.message


def _plan_file(tmp_path: Path, name: str, **model) -> Path:
    m = any_plan(name)
    m = m.model_copy(update={"model": m.model.model_copy(update=model)}) if model else m
    p = tmp_path / f"{name}.yaml"
    write_manifest(m, p)
    return p


def _one_line_exit_2(res, *needles):
    assert res.exit_code == 2, (res.exit_code, res.stderr)
    assert "Traceback" not in res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])


@pytest.mark.parametrize("args,needles", [
    (["--to", "torchrun", "--script", "train.py 'unclosed"], ["field '--script'", "No closing quotation"]),
    (["--to", "torchrun", "--script", "--nnodes=99 train.py"], ["field '--script'", "cannot be placed"]),
    (["--to", "deepspeed", "--script", ""], ["field '--script'", "is empty"]),
    (["--to", "kubernetes", "--image", "img:1\n    evil: true"], ["field '--image'", "not a container image"]),
    (["--to", "kubernetes", "--image", "x; rm -rf ~"], ["field '--image'"]),
    (["--to", "kubernetes", "--image", "-v"], ["field '--image'"]),
])
def test_cli_refuses_values_that_cannot_be_placed(cli, tmp_path, args, needles):
    p = _plan_file(tmp_path, "train-1node")
    _one_line_exit_2(cli("export", str(p), *args), *needles)


def test_cli_refuses_a_flag_as_model_path_and_a_plan_whose_id_is_one(cli, tmp_path):
    p = _plan_file(tmp_path, "serve-1gpu")
    _one_line_exit_2(cli("export", str(p), "--to", "vllm", "--model-path=--trust-remote-code"),
                     "field '--model-path'", "cannot be placed in a command line")
    bad = _plan_file(tmp_path, "serve-1node", hf_id="--trust-remote-code")
    _one_line_exit_2(cli("export", str(bad), "--to", "sglang"), str(bad), "field 'model.hf_id'")
    r = cli("export", str(bad), "--to", "sglang", "-o", str(tmp_path / "out"))
    assert r.exit_code == 2 and not (tmp_path / "out").exists()  # refused before any file is written


def test_a_plan_path_that_looks_like_an_option_is_passed_as_a_path():
    m = any_plan("train-1gpu")
    text = export(m, "torchrun", spec=None, options=ExportOptions(plan_file="-rf.yaml"))[0].text
    assert argv(text[text.index("torchrun "):])[-4:] == ["-m", "shardplan", "verify", "./-rf.yaml"]
