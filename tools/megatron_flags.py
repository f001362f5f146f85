"""Write shardplan/exporters/flags/megatron-<version>.yaml from Megatron-LM's own argument parser.

Megatron-LM's `pretrain_gpt.py` reads its command line with `megatron.training.arguments`
(`add_megatron_arguments`), which since core 0.15 builds many flags from config dataclasses
(`ArgumentGroupFactory(TransformerConfig)` and others), so the flag names are not all literals in
arguments.py: this script imports the parser and walks its actions instead of reading the text.
The megatron-core wheel does not ship `megatron/training`; use a source checkout at a release tag:

    git -C Megatron-LM archive core_v0.19.0 megatron | tar -x -C /tmp/mlm
    python tools/megatron_flags.py /tmp/mlm --tag core_v0.19.0 --commit <sha>

It runs on a CPU-only machine with torch installed: the MoE kernels that import triton at module
level (megatron.core.transformer.moe.ops) are replaced by stubs, which add no flags, and on
Python < 3.12 `typing.override` is shimmed. Nothing from Megatron is copied into the repository
but the flag names, their choices and whether they take a value.
"""

from __future__ import annotations

import argparse
import datetime
import enum
import importlib.abc
import importlib.machinery
import re
import sys
import typing
from pathlib import Path
from unittest import mock

import yaml

OUT = Path(__file__).resolve().parents[1] / "shardplan" / "exporters" / "flags"
STUBBED = ("megatron.core.transformer.moe.ops",)  # import triton at module level; define no arguments


class _Stubs(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        return importlib.machinery.ModuleSpec(name, self, is_package=True) if name.startswith(STUBBED) else None

    def create_module(self, spec):
        m = mock.MagicMock(name=spec.name)
        m.__path__, m.__spec__ = [], spec
        return m

    def exec_module(self, module):
        pass


def megatron_parser(source: Path) -> argparse.ArgumentParser:
    sys.path.insert(0, str(source))
    sys.meta_path.insert(0, _Stubs())
    if not hasattr(typing, "override"):
        typing.override = lambda f: f  # type: ignore[attr-defined]
    from megatron.training.arguments import add_megatron_arguments

    return add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))


# The help of a deprecated flag opens with it ("DEPRECATED: use ...", "[DEPRECATED] ...") or says it
# as a sentence ("... Deprecated: use --position-embedding-type"); not a note on one of its choices.
_DEPRECATED = re.compile(r"^\W*deprecated\b|\bdeprecated(:| from| and replaced)|\. deprecated\.", re.IGNORECASE)


def _plain(choice):
    """A choice as the command line spells it: enums (signal names, attention backends) by name."""
    if isinstance(choice, enum.Enum):
        return choice.name
    return choice if type(choice) in (int, float, str) else str(choice)


def flags(parser: argparse.ArgumentParser) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for action in parser._actions:
        for opt in action.option_strings:
            if not opt.startswith("--") or opt == "--help":
                continue
            entry: dict = {"takes_value": action.nargs != 0}
            if action.choices is not None:
                entry["choices"] = [_plain(c) for c in action.choices]
            if action.nargs not in (None, 0, 1, "?"):
                entry["nargs"] = action.nargs
            if action.help and _DEPRECATED.search(str(action.help)):
                entry["deprecated"] = True
            out[opt[2:]] = entry
    return dict(sorted(out.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source", type=Path, help="folder holding Megatron-LM's megatron/ package at the tag")
    ap.add_argument("--tag", required=True, help="the Megatron-LM git tag, e.g. core_v0.19.0")
    ap.add_argument("--commit", required=True, help="the tag's commit")
    args = ap.parse_args()
    found = flags(megatron_parser(args.source))
    version = args.tag.removeprefix("core_v")
    data = {
        "tool": "megatron-lm",
        "command": "pretrain_gpt.py",
        "version": version,
        "date": datetime.date.today().isoformat(),
        "commit": args.commit,
        "sources": [f"https://github.com/NVIDIA/Megatron-LM/blob/{args.tag}/megatron/training/arguments.py",
                    f"https://github.com/NVIDIA/Megatron-LM/blob/{args.tag}/megatron/training/argument_utils.py"],
        "flags": found,
    }
    header = (f"# Flags of Megatron-LM's pretrain_gpt.py at {args.tag} ({args.commit}), dumped from its own parser\n"
              "# (megatron.training.arguments.add_megatron_arguments) by tools/megatron_flags.py. Regenerate, do not edit.\n"
              "# takes_value: false for switches (store_true/store_false); choices as argparse enforces them;\n"
              "# deprecated: the flag's help says it is (\"DEPRECATED: ...\", \"Deprecated: use ...\").\n")
    path = OUT / f"megatron-{version}.yaml"
    path.write_text(header + yaml.safe_dump(data, sort_keys=False, width=120))
    print(f"{path}: {len(found)} flags")


if __name__ == "__main__":
    main()
