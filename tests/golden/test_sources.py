"""Every published figure the golden tests compare with carries its source: each case, row,
model and section of tests/data/validation/*.yaml, each model of shardplan/validation/corpus/models/*.yaml, each
measurement row of shardplan/validation/corpus/training_stacks/*.yaml and shardplan/validation/corpus/finetune/*.yaml and each table of tests/data/gemm/*.yaml
names where it comes from, so that an entry added without one fails here.

Each file has its own shape (a table whose rows cite a top-level source, cases with a URL,
models with config and parameter-count sources, paper sections with a citation); ENTRIES
says how to find the entries of each, and a file it does not know fails too."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import yaml

from conftest import REPO

DATA = REPO / "tests" / "data"
CORPUS = REPO / "shardplan" / "validation" / "corpus"  # the measured cases `shardplan validate` ships
Entry = tuple[str, Any, tuple[str, ...]]  # (where, the entry, the fields that must name a source)


def _table(doc: dict) -> Iterator[Entry]:
    """A table with one source for all rows (`source: {citation, ...}`) and rows that cite it."""
    yield "source", doc, ("source",)
    yield "source.citation", doc.get("source"), ("citation",)
    for i, row in enumerate(doc.get("rows") or [None]):
        yield f"rows[{i}] ({(row or {}).get('id', '?')})", row, ("source",)


def _cases(doc: dict) -> Iterator[Entry]:
    for i, case in enumerate(doc.get("cases") or [None]):
        yield f"cases[{i}] ({(case or {}).get('id', '?')})", case, ("url",)


def _params(doc: dict) -> Iterator[Entry]:
    for name, model in (doc.get("models") or {None: None}).items():
        yield f"models.{name}", model, ("config_source", "params_source")


def _sections(doc: dict) -> Iterator[Entry]:
    """Top-level sections, each from one paper or code base: `<section>.source`."""
    for name, section in doc.items():
        yield name, section, ("source",)


def _model_file(doc: dict) -> Iterator[Entry]:
    yield "sources", doc, ("sources",)
    yield "sources.config", doc.get("sources"), ("config",)
    if "published_num_params" in doc:
        yield "sources.published_num_params", doc.get("sources"), ("published_num_params",)


def _measurement_rows(doc: dict) -> Iterator[Entry]:
    """Rows of published measurements (shardplan/validation/corpus/training_stacks), each with its own source URL."""
    for i, row in enumerate(doc.get("rows") or [None]):
        yield f"rows[{i}] ({(row or {}).get('id', '?')})", row, ("source",)
        yield f"rows[{i}].source", (row or {}).get("source"), ("url",)


def _cited_rows(doc: dict) -> Iterator[Entry]:
    """Rows that name one of the file's `sources:` by key, each source with a citation and a URL."""
    sources = doc.get("sources") or {None: None}
    for key, source in sources.items():
        yield f"sources.{key}", source, ("citation", "url")
    for i, row in enumerate(doc.get("rows") or [None]):
        cited = (row or {}).get("source")
        yield f"rows[{i}] ({(row or {}).get('id', '?')})", {"source": cited} if cited in sources else {}, ("source",)
        recipe = (row or {}).get("recipe")
        if recipe is not None:  # the settings a row's recipe pins cite their own source
            yield (f"rows[{i}].recipe", {"source": recipe.get("source")} if recipe.get("source") in sources else {},
                   ("source",))


def _one_source(doc: dict) -> Iterator[Entry]:
    """A table transcribed from one source (tests/data/gemm)."""
    yield "source", doc, ("source",)
    yield "source.url", doc.get("source"), ("url",)


ENTRIES: dict[str, Callable[[dict], Iterator[Entry]]] = {
    "validation/activations.yaml": _sections,
    "validation/inference_throughput.yaml": _table,
    "validation/llama3_layouts.yaml": _table,
    "validation/nvidia_layouts.yaml": _cited_rows,
    "validation/published_layouts.yaml": _measurement_rows,
    "validation/params.yaml": _params,
    "validation/serving_memory.yaml": _cases,
    "validation/training_throughput.yaml": _table,
    "validation/zero.yaml": _sections,
}


def _golden_files() -> list[str]:
    files = sorted(p.relative_to(DATA).as_posix() for p in (DATA / "validation").glob("*.yaml"))
    files += sorted(p.relative_to(DATA).as_posix() for p in (DATA / "gemm").glob("*.yaml"))
    for folder in ("models", "training_stacks", "finetune"):
        files += sorted(p.relative_to(CORPUS).as_posix() for p in (CORPUS / folder).glob("*.yaml"))
    return files


def _path(rel: str):
    return CORPUS / rel if rel.startswith(("models/", "training_stacks/", "finetune/")) else DATA / rel


def _has_source(value: Any) -> bool:
    if isinstance(value, str):
        return bool(value.strip())
    if isinstance(value, (list, dict)):
        return bool(value) and all(_has_source(v) for v in (value.values() if isinstance(value, dict) else value))
    return False


def missing_sources(rel: str, doc: Any) -> list[str]:
    if not isinstance(doc, dict):
        return [f"{rel}: not a mapping"]
    entries = (_model_file if rel.startswith("models/") else _measurement_rows if rel.startswith(("training_stacks/", "finetune/"))
               else _one_source if rel.startswith("gemm/") else ENTRIES.get(rel))
    if entries is None:
        return [f"{rel}: a golden file tests/golden/test_sources.py does not know; add its shape to ENTRIES"]
    missing = []
    for where, entry, fields in entries(doc):
        for field in fields:
            if not isinstance(entry, dict) or not _has_source(entry.get(field)):
                missing.append(f"{rel}: {where} has no {field}")
    return missing


@pytest.mark.parametrize("rel", _golden_files())
def test_every_entry_names_its_source(rel):
    doc = yaml.safe_load(_path(rel).read_text())
    missing = missing_sources(rel, doc)
    assert not missing, "\n".join(missing)


def test_every_row_cites_a_source_the_file_describes():
    """The throughput tables' rows cite one source id each; all rows of a file cite the same."""
    for rel in ("validation/inference_throughput.yaml", "validation/training_throughput.yaml"):
        rows = yaml.safe_load((DATA / rel).read_text())["rows"]
        assert len({r["source"] for r in rows}) == 1, rel


def test_the_golden_files_are_all_found():
    files = _golden_files()
    assert set(ENTRIES) <= set(files)
    assert any(f.startswith("models/") for f in files)


@pytest.mark.parametrize("rel,edit", [
    ("validation/inference_throughput.yaml", lambda d: d["rows"].append({"id": "new", "measured": {"x": 1}})),
    ("validation/training_throughput.yaml", lambda d: d["rows"][3].update(source="  ")),
    ("validation/serving_memory.yaml", lambda d: d["cases"][0].pop("url")),
    ("validation/params.yaml", lambda d: d["models"].update(new={"config": {}, "params_total": 1})),
    ("validation/params.yaml", lambda d: d["models"]["gpt2"].update(config_source=[])),
    ("validation/zero.yaml", lambda d: d.update(new_paper={"table": [1, 2]})),
    ("validation/activations.yaml", lambda d: d["korthikanti2022"].pop("source")),
    ("models/llama-7b.yaml", lambda d: d["sources"].pop("published_num_params")),
    ("models/gpt-j-6b.yaml", lambda d: d.pop("sources")),
    ("training_stacks/torchtitan.yaml", lambda d: d["rows"][0]["source"].pop("url")),
    ("training_stacks/megatron.yaml", lambda d: d["rows"].append({"id": "new", "measured": {"x": 1}})),
    ("gemm/h100_bf16_xla.yaml", lambda d: d.pop("source")),
    ("validation/new_table.yaml", lambda d: None),
])
def test_an_entry_without_a_source_is_caught(rel, edit):
    path = _path(rel)
    doc = yaml.safe_load(path.read_text()) if path.is_file() else {"rows": []}
    assert not path.is_file() or not missing_sources(rel, doc)
    edit(doc)
    assert missing_sources(rel, doc)


def test_every_engine_log_names_its_source_in_the_index_and_in_the_file():
    index = yaml.safe_load((CORPUS / "engine_logs" / "index.yaml").read_text())
    logs = {p.stem for p in (CORPUS / "engine_logs").glob("*.log")}
    assert {e["id"] for e in index} == logs  # every log indexed, every entry has its log
    for e in index:
        assert str(e["source"]).strip(), e["id"]
        first = (CORPUS / "engine_logs" / f"{e['id']}.log").read_text().splitlines()[0]
        assert first.startswith("# source:") and len(first) > len("# source: "), e["id"]


def test_every_decode_measurement_names_its_source():
    rows = [r for f in ("measurements.yaml", "measurements_more.yaml")
            for r in yaml.safe_load((DATA / "decode_eager" / f).read_text())["rows"]]
    assert len(rows) >= 4
    cases = yaml.safe_load((DATA / "decode_eager" / "host_cases.yaml").read_text())["cases"]
    assert {c["row"] for c in cases} <= {r["id"] for r in rows}  # every prediction case is a sourced row
    for row in rows:
        assert str(row["source"]).strip(), row["id"]
        # a missing figure is said to be missing, never left blank without a word
        assert row["eager"] is not None or str(row.get("notes") or "").strip(), row["id"]
