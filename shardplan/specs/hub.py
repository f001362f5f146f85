"""Hugging Face Hub ids as model and checkpoint arguments: `org/name` or `org/name@revision`.

Two halves. `parse_hub_id` is pure: it accepts only what the Hub itself accepts as a repo id
(huggingface_hub `validate_repo_id`: word characters, `-` and `.`, no `--` or `..`, at most 96
characters) and a ref name or commit hash as the revision, so nothing hostile (a path, `..`, a
URL, a space) ever reaches the network or the cache. The rest is the I/O edge: files come through
`huggingface_hub` (imported here only, and only when an id is used), the local cache first
(`local_files_only=True`), then the Hub unless HF_HUB_OFFLINE is set. The token is whatever
huggingface_hub finds (HF_TOKEN, `hf auth login`); shardplan never reads or prints it.

A model read from the Hub is recorded as `hf:org/name@<commit>` (HUB_PREFIX): the commit the
revision resolved to, so a plan names exactly the config it was made from.
"""

from __future__ import annotations

import logging
import os
import re
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

from shardplan.errors import InputFileError, ShardplanError

HUB_PREFIX = "hf:"
MAX_REPO_ID_CHARS = 96  # huggingface_hub validate_repo_id
MAX_REVISION_CHARS = 200
_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9._-]*[A-Za-z0-9_])?"
_REPO_ID = re.compile(rf"{_PART}/{_PART}")
# A branch or tag (refs/pr/1, v1.0, main) or a commit hash: git ref characters only.
_REVISION = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._/+-]*")
_COMMIT = re.compile(r"[0-9a-f]{40}")
EXAMPLE = "meta-llama/Llama-3.1-8B"
ID_HINT = f"pass org/name or org/name@revision, e.g. {EXAMPLE}@main"
INSTALL_HINT = "pip install 'shardplan[hf]'"


@dataclass(frozen=True)
class HubRef:
    """A Hub model repository and, optionally, a revision (branch, tag or commit hash)."""

    repo_id: str  # org/name
    revision: str | None = None  # None: the repository's default branch (main)

    def __str__(self) -> str:
        return self.repo_id if self.revision is None else f"{self.repo_id}@{self.revision}"

    @property
    def name(self) -> str:
        return self.repo_id.split("/", 1)[1]


def _shown(text: str) -> str:
    """The argument as a message may quote it: bounded, whitespace made visible."""
    shown = text if len(text) <= 80 else text[:77] + "..."
    return repr(shown)


def is_commit_hash(revision: str | None) -> bool:
    return revision is not None and _COMMIT.fullmatch(revision) is not None


def looks_like_local_path(text: str) -> bool:
    """Written as a path: absolute, relative to here or home, or a file with a config suffix."""
    return text.startswith(("/", "./", "../", "~", "\\")) or os.path.isabs(text) or \
        Path(text).suffix.lower() in (".json", ".yaml", ".yml")


def is_hub_candidate(text: str) -> bool:
    """Shaped like `org/name[@rev]` (or a URL), not like a path: try the Hub rather than say
    "file not found". Checked only after the local path and the bundled names. A name whose first
    component is a folder here (`ckpts/llama-8b` with ./ckpts present) is a mistyped local path:
    it is never sent to the Hub (that would leak the path, with the user's token); `hf:` forces
    the Hub reading."""
    if text.startswith(HUB_PREFIX):
        return True
    if looks_like_local_path(text) or not ("/" in text or "://" in text):
        return False
    first = text.split("/", 1)[0]
    return "://" in text or not (first and Path(first).is_dir())


def parse_hub_id(text: str) -> HubRef:
    """`org/name`, `org/name@revision`, either with the `hf:` prefix. Anything else is an
    InputFileError naming what is wrong; nothing is looked up."""
    what = "not a file, and not a Hugging Face id"
    raw = text.removeprefix(HUB_PREFIX)

    def bad(reason: str) -> InputFileError:
        return InputFileError(f"{what}: {reason}", source=_shown(text), hint=ID_HINT)

    if len(raw) > MAX_REPO_ID_CHARS + 1 + MAX_REVISION_CHARS:
        raise bad(f"longer than {MAX_REPO_ID_CHARS + 1 + MAX_REVISION_CHARS} characters")
    if "://" in raw or raw.lower().startswith(("http:", "https:", "hf.co/", "huggingface.co/")):
        raise bad("a URL; give the id the URL ends with")
    repo_id, at, revision = raw.partition("@")
    if repo_id.count("/") != 1:
        raise bad("an id is exactly one org and one name, org/name")
    if ".." in repo_id or "--" in repo_id:
        raise bad("'..' and '--' are not allowed in an id")
    if len(repo_id) > MAX_REPO_ID_CHARS:
        raise bad(f"the id is longer than {MAX_REPO_ID_CHARS} characters")
    if not _REPO_ID.fullmatch(repo_id):
        raise bad("org and name are letters, digits, '-', '_' and '.', starting and ending with a letter or digit")
    if not at:
        return HubRef(repo_id)
    if not revision:
        raise bad("nothing after '@'; give a branch, tag or commit hash")
    if len(revision) > MAX_REVISION_CHARS:
        raise bad(f"the revision is longer than {MAX_REVISION_CHARS} characters")
    if ".." in revision or "//" in revision or revision.endswith(("/", ".", ".lock")) \
            or not _REVISION.fullmatch(revision):
        raise bad("the revision must be a branch, tag or commit hash (letters, digits, '.', '_', '-', '+', '/'; "
                  "no '..', spaces, or leading '-')")
    return HubRef(repo_id, revision)


# ----- the I/O edge: huggingface_hub --------------------------------------------------------


def _hf() -> Any:
    """huggingface_hub, imported only when a Hub id is used (it is an optional extra)."""
    try:
        import huggingface_hub
        import huggingface_hub.constants
        import huggingface_hub.errors  # noqa: F401 - submodules: `hf.errors` is not loaded by the package
    except ImportError:
        raise ShardplanError("reading a Hugging Face id needs the huggingface_hub package", hint=INSTALL_HINT) from None
    return huggingface_hub


def _truthy(value: str | None) -> bool:
    return (value or "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE), read now: huggingface_hub reads it once, at import."""
    if _truthy(os.environ.get("HF_HUB_OFFLINE")) or _truthy(os.environ.get("TRANSFORMERS_OFFLINE")):
        return True
    hf = _hf()
    return bool(getattr(hf.constants, "HF_HUB_OFFLINE", False))


def cache_dir() -> str | None:
    """The Hub cache as the environment names it now (HF_HUB_CACHE, else HF_HOME/hub), else
    huggingface_hub's own default (None)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")
    return None


def _download_command(ref: HubRef, filename: str) -> str:
    rev = f" --revision {ref.revision}" if ref.revision else ""
    return f"hf download {ref.repo_id} {filename}{rev}"


T = TypeVar("T")


def _hub_call(ref: HubRef, what: str, call: Callable[[], T]) -> T:
    """Run one Hub request; every failure becomes one line naming the id and the fix. The
    library's own message is not repeated: it can be long, and it is not ours to show."""
    hf = _hf()
    err = hf.errors
    source = str(ref)
    unreachable = InputFileError(f"{what}: cannot reach the Hugging Face Hub, and the local cache does not hold it",
                                 source=source, hint="check the network, or run once online so the cache holds it")
    if not _resolves(getattr(hf.constants, "ENDPOINT", "https://huggingface.co")):
        raise unreachable  # no name service for the Hub: its client would retry for half a minute
    quiet = logging.getLogger("huggingface_hub")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # its retry warnings are not ours to print: the failure is one line
    try:
        return call()
    except err.GatedRepoError:
        raise InputFileError(f"{what}: the repository is gated", source=source,
                             hint="accept its licence on huggingface.co, then `hf auth login` or set HF_TOKEN") from None
    except err.RepositoryNotFoundError:
        raise InputFileError(f"{what}: no such repository, or it is private", source=source,
                             hint=f"check the id; for a private one `hf auth login` or set HF_TOKEN; {ID_HINT}") from None
    except err.RevisionNotFoundError:
        raise InputFileError(f"{what}: no revision {ref.revision!r}", source=source,
                             hint="name a branch, tag or commit hash of the repository") from None
    except err.LocalEntryNotFoundError:  # an EntryNotFoundError too: the Hub was not reached, the cache lacks it
        raise unreachable from None
    except err.EntryNotFoundError:
        raise InputFileError(f"{what}: the repository has no such file", source=source,
                             hint="check that it is a transformers model repository") from None
    except err.NotASafetensorsRepoError:
        raise InputFileError(f"{what}: no model.safetensors or model.safetensors.index.json", source=source,
                             hint="this reads safetensors checkpoints only") from None
    except err.SafetensorsParsingError:
        raise InputFileError(f"{what}: a safetensors header could not be parsed", source=source,
                             hint="check the repository's safetensors files") from None
    except err.HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        raise InputFileError(f"{what}: the Hub answered HTTP {status}", source=source,
                             hint="try again later, or check the id and your token") from None
    except Exception as e:  # noqa: BLE001 - no connection, a timeout (httpx's errors are not OSErrors), offline
        raise InputFileError(f"{what}: cannot reach the Hugging Face Hub ({type(e).__name__})", source=source,
                             hint="check the network, or run once online so the cache holds it") from None
    finally:
        quiet.setLevel(level)


def _resolves(endpoint: str) -> bool:
    """Whether the Hub endpoint's host name resolves (a proxy resolves it itself: then assume so)."""
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    host = urlsplit(endpoint).hostname
    if not host:
        return True
    try:
        socket.getaddrinfo(host, 443)
    except OSError:  # socket.gaierror: no such name, or no name service
        return False
    return True


def pinned(ref: HubRef, commit: str | None) -> str:
    """`hf:org/name@<commit>`: where a file came from, the revision replaced by its commit
    (a plan records this; `load_model` reads it back from the cache)."""
    return f"{HUB_PREFIX}{ref.repo_id}@{commit or ref.revision or 'main'}"


@dataclass(frozen=True)
class HubFile:
    """A file of a Hub repository, as a path in the local cache."""

    ref: HubRef
    path: Path
    commit: str | None  # the commit the revision resolved to (the cache snapshot's name)

    @property
    def origin(self) -> str:
        return pinned(self.ref, self.commit)


def download(ref: HubRef, filename: str) -> HubFile:
    """`filename` of the repository: from the local cache if it holds it, else from the Hub
    (unless offline). huggingface_hub keeps it in the cache (snapshots/<commit>/<filename>)."""
    hf = _hf()
    kwargs: dict[str, Any] = dict(repo_id=ref.repo_id, filename=filename, revision=ref.revision,
                                  repo_type="model", cache_dir=cache_dir())
    try:
        path = hf.hf_hub_download(**kwargs, local_files_only=True)
    except (hf.errors.LocalEntryNotFoundError, hf.errors.EntryNotFoundError, FileNotFoundError):
        if offline():
            raise InputFileError(
                f"{filename} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set", source=str(ref),
                hint=f"run once online, or `{_download_command(ref, filename)}`") from None
        path = _hub_call(ref, f"cannot fetch {filename}", lambda: hf.hf_hub_download(**kwargs))
    path = Path(path)
    commit = path.parent.name if is_commit_hash(path.parent.name) else None
    return HubFile(ref=ref, path=path, commit=commit)


# ----- safetensors headers, without the weights ---------------------------------------------


@dataclass(frozen=True)
class RemoteTensor:
    """One entry of a safetensors header as the Hub reports it."""

    dtype: str
    shape: tuple[int, ...]
    data_offsets: tuple[int, int]  # [begin, end) inside the file's data section


@dataclass(frozen=True)
class RemoteShard:
    """One safetensors file of a Hub checkpoint: its size and its header's tensors."""

    file: str
    size_bytes: int
    tensors: dict[str, RemoteTensor]


@dataclass(frozen=True)
class RemoteCheckpoint:
    ref: HubRef
    commit: str | None
    weight_map: dict[str, str]  # tensor name -> file
    shards: list[RemoteShard]

    @property
    def origin(self) -> str:
        return pinned(self.ref, self.commit)


def safetensors_headers(ref: HubRef) -> RemoteCheckpoint:
    """The index and every shard's header of a Hub checkpoint, by HTTP range requests
    (huggingface_hub `get_safetensors_metadata`), and each file's size (`get_paths_info`):
    no weights are downloaded. The revision is pinned first to the commit its config.json
    resolves to, so the headers and the sizes describe the same commit."""
    if offline():
        raise InputFileError("reading a Hub checkpoint's headers needs the Hub, and HF_HUB_OFFLINE is set",
                             source=str(ref), hint=f"unset HF_HUB_OFFLINE, or `hf download {ref.repo_id} --include "
                             "'*.safetensors' '*.json' --local-dir DIR` and pass DIR")
    hf = _hf()
    commit = download(ref, "config.json").commit
    revision = commit or ref.revision
    meta = _hub_call(ref, "cannot read the safetensors headers",
                     lambda: hf.get_safetensors_metadata(ref.repo_id, revision=revision))
    files = sorted(meta.files_metadata)
    infos = _hub_call(ref, "cannot read the file sizes",
                      lambda: hf.get_paths_info(ref.repo_id, files, revision=revision, repo_type="model"))
    sizes = {getattr(i, "path", None): getattr(i, "size", None) for i in infos}
    shards = []
    for rel in files:
        size = sizes.get(rel)
        if not isinstance(size, int):
            raise InputFileError(f"the Hub gave no size for {rel!r}", source=str(ref),
                                 hint="check that every shard of the checkpoint is in the repository")
        try:
            tensors = {name: RemoteTensor(dtype=str(t.dtype), shape=tuple(t.shape), data_offsets=tuple(t.data_offsets))
                       for name, t in meta.files_metadata[rel].tensors.items()}
        except (TypeError, AttributeError):
            raise InputFileError(f"the header of {rel!r} has an entry without a shape or data_offsets", source=str(ref),
                                 hint="check the repository's safetensors files") from None
        shards.append(RemoteShard(file=rel, size_bytes=size, tensors=tensors))
    return RemoteCheckpoint(ref=ref, commit=commit, weight_map=dict(meta.weight_map), shards=shards)
