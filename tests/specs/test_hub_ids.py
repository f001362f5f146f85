"""Hugging Face Hub ids as MODEL: the pure parser (what it accepts, what it refuses and why) and
resolution from a real huggingface_hub cache laid out in tmp_path. The network is never
reached: the cache tests run with HF_HUB_OFFLINE=1; the online path is a monkeypatched
`hf_hub_download`."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import huggingface_hub.constants
import pytest
from huggingface_hub import errors as hf_errors

from shardplan.cost.params import count_params
from shardplan.errors import InputFileError, ShardplanError
from shardplan.specs import hub, loading
from shardplan.specs.loading import load_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"
TINY = {
    "model_type": "llama", "hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 2,
    "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 1000, "max_position_embeddings": 256,
    "torch_dtype": "bfloat16",
}
# embeddings and the untied head 2 x 1000 x 512; per layer q,o 2 x 512^2, k,v 2 x 512 x 256,
# mlp 3 x 512 x 1024, two norms 2 x 512; the final norm 512
TINY_NUM_PARAMS = 2 * 1000 * 512 + 2 * (2 * 512**2 + 2 * 512 * 256 + 3 * 512 * 1024 + 2 * 512) + 512


def hub_cache(root: Path, repo_id: str, files: dict[str, bytes], commit: str = COMMIT,
              refs: tuple[str, ...] = ("main",)) -> Path:
    """A huggingface_hub cache as `hf download` leaves it: models--org--name/{blobs,snapshots,refs}."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True, exist_ok=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for i, (name, data) in enumerate(files.items()):
        blob = repo / "blobs" / f"{i:040x}"
        blob.write_bytes(data)
        (snap / name).symlink_to(Path("..") / ".." / "blobs" / blob.name)
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return root


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    root = hub_cache(tmp_path / "hub", "org/tiny", {"config.json": json.dumps(TINY).encode()}, refs=("main", "v1.0"))
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    return root


# ----- the parser (pure) ---------------------------------------------------------------------


@pytest.mark.parametrize("text, repo_id, revision", [
    ("org/name", "org/name", None),
    ("meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-8B", None),
    ("Qwen/Qwen2.5-7B-Instruct@main", "Qwen/Qwen2.5-7B-Instruct", "main"),
    ("org/name@v1.0", "org/name", "v1.0"),
    (f"org/name@{COMMIT}", "org/name", COMMIT),
    ("hf:org/name@refs/pr/1", "org/name", "refs/pr/1"),
    ("a_b/c.d-e", "a_b/c.d-e", None),
])
def test_accepted_ids(text, repo_id, revision):
    ref = hub.parse_hub_id(text)
    assert (ref.repo_id, ref.revision) == (repo_id, revision)
    assert ref.name == repo_id.split("/")[1]
    assert hub.is_commit_hash(ref.revision) == (revision == COMMIT)


@pytest.mark.parametrize("text, reason", [
    ("../../etc/passwd", "exactly one org and one name"),
    ("/abs/path/x", "exactly one org and one name"),
    ("https://huggingface.co/x/y", "a URL"),
    ("huggingface.co/x/y", "a URL"),
    ("org/..", "'..'"),
    ("../name", "'..'"),
    ("org/na--me", "'--'"),
    ("org/name@../x", "the revision must be"),
    ("org/name@ main", "the revision must be"),
    ("org/name@main\nrm -rf /", "the revision must be"),
    ("org/name@-x", "the revision must be"),
    ("org/name@main.lock", "the revision must be"),
    ("org/name@", "nothing after '@'"),
    ("org/na me", "letters, digits"),
    ("org/.name", "letters, digits"),
    ("a/b/c", "exactly one org and one name"),
    ("org/" + "n" * 100, "longer than 96"),
    ("org/name@" + "a" * 250, "revision is longer"),
    ("org/name@" + "a" * 5000, "longer than"),
    ("hf:../x", "'..'"),
])
def test_refused_ids_say_why_in_one_bounded_line(text, reason):
    with pytest.raises(InputFileError) as info:
        hub.parse_hub_id(text)
    line = info.value.one_line()
    assert reason in line and "\n" not in line and len(line) < 400, line
    assert "not a Hugging Face id" in line and "meta-llama/Llama-3.1-8B" in line  # the fix shows the form


@pytest.mark.parametrize("text, candidate", [
    ("org/name", True), ("org/name@v1", True), ("hf:gpt2", True), ("https://huggingface.co/x/y", True),
    ("./org/name", False), ("/abs/org/name", False), ("../x/y", False), ("~/x/y", False),
    ("models/x.yaml", False), ("dir/config.json", False), ("llama-3.1-8b", False),
])
def test_what_is_tried_on_the_hub(text, candidate):
    assert hub.is_hub_candidate(text) is candidate


# ----- resolution from a real cache (huggingface_hub's own code, offline) ---------------------


def test_cached_config_resolves_offline_and_records_the_commit(offline_cache):
    for arg in ("org/tiny", "org/tiny@v1.0", f"org/tiny@{COMMIT}", "hf:org/tiny"):
        m = load_model(arg)
        assert count_params(m.spec).total == TINY_NUM_PARAMS
        assert m.origin == m.spec.source == f"hf:org/tiny@{COMMIT}"
        assert m.hf_id == "org/tiny" and m.spec.name == "tiny"


def test_not_cached_offline_is_one_line_naming_the_fix(offline_cache):
    with pytest.raises(InputFileError) as info:
        load_model("org/absent@v2")
    line = info.value.one_line()
    assert line.startswith("org/absent@v2:") and "HF_HUB_OFFLINE" in line
    assert "hf download org/absent config.json --revision v2" in line


def test_an_existing_local_path_wins(offline_cache, tmp_path):
    local = tmp_path / "org" / "tiny"
    local.mkdir(parents=True)
    (local / "config.json").write_text(json.dumps({**TINY, "num_hidden_layers": 4}))
    assert load_model("org/tiny").spec.num_layers == 4
    assert load_model("hf:org/tiny").spec.num_layers == 2  # hf: always means the Hub


def test_cached_config_goes_through_the_bounded_reader(offline_cache, monkeypatch):
    monkeypatch.setattr(loading, "MAX_INPUT_FILE_BYTES", 64)
    with pytest.raises(InputFileError) as info:
        load_model("org/tiny")
    assert "over the 64 byte limit" in info.value.one_line()
    assert f"hf:org/tiny@{COMMIT}/config.json" in info.value.one_line()


def test_without_huggingface_hub_says_how_to_install(offline_cache, monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import raises ImportError
    with pytest.raises(ShardplanError) as info:
        load_model("org/tiny")
    assert "pip install 'shardplan[hf]'" in info.value.one_line()


# ----- the online path (mocked: nothing reaches the network) ---------------------------------


@pytest.fixture
def online(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub, "_resolves", lambda endpoint: True)  # the mocked Hub's name resolves
    monkeypatch.chdir(tmp_path)
    return tmp_path / "hub"


def test_the_cache_is_tried_first_then_the_hub(online, monkeypatch):
    calls = []

    def fake_download(*, repo_id, filename, revision, local_files_only=False, cache_dir=None, **_):
        calls.append(local_files_only)
        if local_files_only:
            raise hf_errors.LocalEntryNotFoundError("not cached")
        hub_cache(Path(cache_dir), repo_id, {filename: json.dumps(TINY).encode()})
        return str(Path(cache_dir) / f"models--{repo_id.replace('/', '--')}" / "snapshots" / COMMIT / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    m = load_model("org/tiny")
    assert calls == [True, False]
    assert m.origin == f"hf:org/tiny@{COMMIT}" and count_params(m.spec).total == TINY_NUM_PARAMS


def _raising(exc: Exception):
    def fake_download(*, local_files_only=False, **_):
        if local_files_only:
            raise hf_errors.LocalEntryNotFoundError("not cached")
        raise exc
    return fake_download


_RESPONSE = SimpleNamespace(headers={}, request=None, status_code=404)


@pytest.mark.parametrize("exc, words", [
    (hf_errors.GatedRepoError("gated", response=_RESPONSE), "gated"),
    (hf_errors.RepositoryNotFoundError("nope", response=_RESPONSE), "no such repository"),
    (hf_errors.RevisionNotFoundError("nope", response=_RESPONSE), "no revision"),
    (hf_errors.LocalEntryNotFoundError("no connection"), "cannot reach the Hugging Face Hub"),
    (ConnectionError("dns"), "cannot reach the Hugging Face Hub"),
])
def test_hub_failures_are_one_line_naming_the_id(online, monkeypatch, exc, words):
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", _raising(exc))
    with pytest.raises(InputFileError) as info:
        load_model("org/tiny@v3")
    line = info.value.one_line()
    assert line.startswith("org/tiny@v3:") and words in line and "\n" not in line, line


def test_no_name_service_fails_at_once_without_the_clients_retries(online, monkeypatch, capsys):
    """Without DNS for the Hub (an offline machine), huggingface_hub retries for ~25 s, printing a warning
    each time: the lookup is refused at once, in one line, and the client is never called."""
    monkeypatch.setattr(hub, "_resolves", lambda endpoint: False)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", _raising(AssertionError("the client was called")))
    with pytest.raises(InputFileError) as info:
        load_model("org/tiny")
    assert "cannot reach the Hugging Face Hub" in info.value.one_line()
    assert capsys.readouterr().err == ""


def test_an_unresolvable_host_is_not_resolved(monkeypatch):
    for var in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    assert hub._resolves("https://no-such-host.invalid") is False  # RFC 2606: .invalid never resolves
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy:3128")
    assert hub._resolves("https://no-such-host.invalid") is True  # the proxy resolves names itself
