"""Write shardplan/exporters/flags/torchtitan-<version>.yaml: every key of torchtitan's job config.

torchtitan (through 0.2.x) reads a job TOML whose `[section]` tables and keys are the fields of
the `JobConfig` dataclass tree (torchtitan/config/job_config.py); its ConfigManager refuses a key
that is not a field (`_dict_to_dataclass`: "Invalid field names"). The same keys are its command
line overrides, `--section.key value`. This script imports job_config.py from an installed
torchtitan without running the package's __init__ (which imports CUDA/triton kernels), walks the
dataclasses and writes each leaf as `section.key` with its type and, for Literal types, choices:

    pip install --no-deps torchtitan==0.2.2 && pip install tyro
    python tools/torchtitan_keys.py

torchtitan 0.3 replaced the TOML files by Python config registries (`--module/--config`); the
TOML target stays pinned to 0.2.2, the last release that reads them.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import importlib.util
import sys
import types
import typing
from pathlib import Path

import yaml

OUT = Path(__file__).resolve().parents[1] / "shardplan" / "exporters" / "flags"


def job_config_module():
    """torchtitan.config.job_config, imported without torchtitan/__init__.py."""
    spec = importlib.util.find_spec("torchtitan")
    if spec is None:
        raise SystemExit("torchtitan is not installed: pip install --no-deps torchtitan==0.2.2")
    pkg = types.ModuleType("torchtitan")
    pkg.__path__ = list(spec.submodule_search_locations)
    sys.modules.setdefault("torchtitan", pkg)
    import torchtitan.config.job_config as jc

    return jc


def _type_name(t) -> str:
    return getattr(t, "__name__", None) or str(t).replace("typing.", "")


def leaves(cls, prefix: str = "") -> dict[str, dict]:
    out: dict[str, dict] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        t = hints[f.name]
        if dataclasses.is_dataclass(t):
            out.update(leaves(t, f"{prefix}{f.name}."))
            continue
        entry: dict = {"takes_value": True, "type": _type_name(t)}
        args = [a for a in typing.get_args(t) if a is not type(None)]
        literal = t if typing.get_origin(t) is typing.Literal else next(
            (a for a in args if typing.get_origin(a) is typing.Literal), None)
        if literal is not None:
            entry["choices"] = list(typing.get_args(literal))
        out[f"{prefix}{f.name}"] = entry
    return out


def main() -> None:
    jc = job_config_module()
    version = importlib.metadata.version("torchtitan")
    data = {
        "tool": "torchtitan",
        "command": "torchtitan.train",
        "version": version,
        "date": datetime.date.today().isoformat(),
        "sources": [f"https://github.com/pytorch/torchtitan/blob/v{version}/torchtitan/config/job_config.py",
                    f"https://github.com/pytorch/torchtitan/blob/v{version}/torchtitan/config/manager.py"],
        "flags": leaves(jc.JobConfig),
    }
    header = (f"# Keys of torchtitan {version}'s job config (the TOML's [section] key, or --section.key on its\n"
              "# command line), from the JobConfig dataclasses by tools/torchtitan_keys.py. Regenerate, do not edit.\n")
    path = OUT / f"torchtitan-{version}.yaml"
    path.write_text(header + yaml.safe_dump(data, sort_keys=False, width=120))
    print(f"{path}: {len(data['flags'])} keys")


if __name__ == "__main__":
    main()
