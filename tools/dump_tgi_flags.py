"""Dump TGI's `text-generation-launcher` flags from its clap `Args` struct, cross-checked against its docs.

    python tools/dump_tgi_flags.py --git-dir /work/.mirror/huggingface+text-generation-inference/repo --tag v3.3.7
    python tools/dump_tgi_flags.py --main-rs main.rs --launcher-md launcher.md --tag v3.3.7 --commit <sha>

The launcher is Rust (clap 4 derive), so there is no parser to import. This script reads two files of
one commit (a release tag of huggingface/text-generation-inference):
1. launcher/src/main.rs: the `struct Args` that `#[derive(Parser)]` turns into the command line, and the
   `#[derive(ValueEnum)]` enums its fields use. clap derive's rules, as applied here:
   - each field is `--kebab-case` of its name (`long`, or `long = "x"`); `short` alone is the field's
     first letter, `short = 'x'` that letter; `env` alone is the field's name in upper case;
   - `bool` is a SetTrue switch (no value; `value_enum` on a bool changes nothing, launcher.md shows
     `--trust-remote-code` without a value); `Option<bool>` takes `true|false`;
   - a field whose type (inside Option/Vec) is one of the ValueEnum enums takes one of its variants:
     `#[clap(name = "x")]` / `#[value(name = "x")]` where given, else the variant in kebab-case;
   - `Vec<T>` may be repeated (or split by `value_delimiter`); `hide`/`hidden` options are marked;
   - clap adds `--help` (`-h`) and, with `#[clap(version)]` on the struct, `--version` (`-V`).
   clap has no "deprecated" attribute: an option is marked deprecated only when its doc comment says
   "deprecated" (TGI's --max-input-length says "Legacy version of ...", which is not a deprecation).
2. docs/source/reference/launcher.md: the launcher's own `--help` output (TGI's CI regenerates it from
   the binary), read for each option's name, short alias, whether it takes a value, its possible
   values and its environment variable. Every option is compared with the struct's reading; any
   disagreement stops the script (exit 1) and lists them, so a misreading of the Rust cannot pass.

Writes shardplan/exporters/flags/tgi-<version>.yaml: version, date, the commit, the source URLs at the
tag and at the commit, and per option takes_value, choices, short, env, hidden, repeatable, deprecated.
The version in Cargo.toml at the tag is recorded too (TGI's v3.3.6 and v3.3.7 tags both say
3.3.6-dev0, which is what `--version` prints there).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
FLAGS_DIR = REPO / "shardplan" / "exporters" / "flags"
GITHUB = "https://github.com/huggingface/text-generation-inference"
MAIN_RS = "launcher/src/main.rs"
LAUNCHER_MD = "docs/source/reference/launcher.md"


@dataclass
class Option_:
    """One long option as clap builds it from a struct field."""
    name: str  # without the leading dashes
    takes_value: bool
    choices: list[str] | None = None
    short: str | None = None
    env: str | None = None
    hidden: bool = False
    repeatable: bool = False
    deprecated: bool = False
    note: str | None = None
    rust_type: str = ""

    def as_yaml(self) -> dict[str, Any]:
        out: dict[str, Any] = {"takes_value": self.takes_value}
        for key in ("choices", "short", "env"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        for key in ("hidden", "repeatable", "deprecated"):
            if getattr(self, key):
                out[key] = True
        if self.note:
            out["note"] = self.note
        if self.rust_type:
            out["rust_type"] = self.rust_type
        return out


# ----- main.rs ------------------------------------------------------------------------------------


def strip_line_comments(text: str) -> str:
    """Rust `//` comments removed, `///` doc comments kept (they are the options' help)."""
    return "\n".join(line if line.lstrip().startswith("///") else re.sub(r"(?<!:)//(?!/).*$", "", line)
                     for line in text.splitlines())


def kebab(name: str) -> str:
    """clap's default case for long names and ValueEnum variants: snake_case and CamelCase to kebab-case
    (`max_input_tokens` -> max-input-tokens, `BitsandbytesNf4` -> bitsandbytes-nf4, `NoStack` -> no-stack)."""
    s = re.sub(r"([a-z0-9])([A-Z])", r"\1-\2", name)
    s = re.sub(r"([A-Z]+)([A-Z][a-z])", r"\1-\2", s)
    return s.replace("_", "-").lower()


def _block(text: str, header: re.Pattern[str]) -> tuple[str, int] | None:
    """The body between the braces that follow `header`, and where the header starts."""
    m = header.search(text)
    if m is None:
        return None
    start = text.index("{", m.end() - 1)
    depth = 0
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + 1:i], m.start()
    raise ValueError("unbalanced braces")


def _attrs(text: str) -> str:
    return " ".join(re.findall(r"#\[(?:clap|arg|value)\((.*?)\)\]", text))


def _attr_value(attrs: str, key: str) -> str | None:
    """`key = "x"` or `key = 'x'` in an attribute list; "" for `key` alone; None when absent."""
    m = re.search(rf"(?:^|[\s,(]){key}\s*=\s*(?:\"([^\"]*)\"|'(.)')", attrs)
    if m:
        return m.group(1) if m.group(1) is not None else m.group(2)
    return "" if re.search(rf"(?:^|[\s,(]){key}(?:\s*[,)]|\s*$)", attrs) else None


def parse_value_enums(text: str) -> dict[str, list[str]]:
    """Enum name -> its ValueEnum values as clap accepts them."""
    text = strip_line_comments(text)
    out: dict[str, list[str]] = {}
    for m in re.finditer(r"#\[derive\(([^)]*)\)\]\s*(?:#\[[^\]]*\]\s*)*(?:pub\s+)?enum\s+(\w+)", text):
        if "ValueEnum" not in m.group(1):
            continue
        body, _ = _block(text[m.start():], re.compile(rf"enum\s+{m.group(2)}\s*\{{"))
        values = []
        pending = ""
        for line in body.splitlines():
            s = line.strip()
            if s.startswith("#["):
                pending += s
                continue
            v = re.match(r"(\w+)\s*,?$", s)
            if v:
                name = _attr_value(_attrs(pending), "name")
                values.append(name if name else kebab(v.group(1)))
                pending = ""
        out[m.group(2)] = values
    return out


_DEPRECATED_DOC = re.compile(r"^\s*\[?deprecated\b|\bis deprecated\b", re.I | re.M)


def parse_args_struct(text: str, enums: dict[str, list[str]], struct: str = "Args") -> list[Option_]:
    """The options of `struct Args` in declaration order, then clap's --help and --version."""
    text = strip_line_comments(text)
    found = _block(text, re.compile(rf"struct\s+{struct}\s*\{{"))
    if found is None:
        raise LookupError(f"no struct {struct} in the source")
    body, at = found
    struct_attrs = _attrs(text[max(0, at - 300):at].split("\n}")[-1])
    out: list[Option_] = []
    attrs, docs = "", []
    for line in body.splitlines():
        s = line.strip()
        if s.startswith("///"):
            docs.append(s[3:].strip())
        elif s.startswith("#["):
            attrs += " " + _attrs(s)
        elif m := re.match(r"(?:pub\s+)?(\w+)\s*:\s*(.+?),?$", s):
            out.append(_option(m.group(1), m.group(2).rstrip(","), attrs, " ".join(docs), enums))
            attrs, docs = "", []
    out.append(Option_("help", False, short="h"))
    if _attr_value(struct_attrs, "version") is not None:
        out.append(Option_("version", False, short="V"))
    return out


def _option(field_name: str, rust_type: str, attrs: str, doc: str, enums: dict[str, list[str]]) -> Option_:
    long = _attr_value(attrs, "long")
    if long is None:
        raise ValueError(f"field {field_name} has no `long`: not a --flag (positional arguments are not read here)")
    short = _attr_value(attrs, "short")
    env = _attr_value(attrs, "env")
    inner = re.sub(r"^(?:Option|Vec)<(.*)>$", r"\1", rust_type)
    inner = re.sub(r"^(?:Option|Vec)<(.*)>$", r"\1", inner)
    opt = Option_(
        name=long or kebab(field_name),
        takes_value=rust_type != "bool",
        short=(short or field_name[0]) if short is not None else None,
        env=(env or field_name.upper()) if env is not None else None,
        hidden=_attr_value(attrs, "hide") is not None or _attr_value(attrs, "hidden") is not None,
        repeatable=rust_type.startswith("Vec<") or "Vec<" in rust_type,
        rust_type=rust_type,
    )
    if rust_type == "Option<bool>":
        opt.choices = ["true", "false"]
    elif inner in enums:
        opt.choices = list(enums[inner])
    if doc and _DEPRECATED_DOC.search(doc):
        opt.deprecated, opt.note = True, " ".join(doc.split())[:200]
    return opt


# ----- launcher.md ------------------------------------------------------------------------------

_OPTION_LINE = re.compile(r"^\s*(?:-(\w), )?--([a-z0-9-]+)(?: <([A-Z0-9_]+)>)?\s*$")


def parse_launcher_md(text: str) -> dict[str, dict[str, Any]]:
    """Option name -> takes_value, short, choices, env, as the `--help` text in launcher.md shows them."""
    out: dict[str, dict[str, Any]] = {}
    current: dict[str, Any] | None = None
    in_list = False
    for line in text.splitlines():
        m = _OPTION_LINE.match(line)
        if m:
            current = {"takes_value": m.group(3) is not None, "short": m.group(1), "choices": None, "env": None}
            out[m.group(2)] = current
            in_list = False
            continue
        if current is None:
            continue
        s = line.strip()
        if pv := re.match(r"\[possible values: (.*)\]$", s):
            current["choices"] = [v.strip() for v in pv.group(1).split(",")]
        elif env := re.match(r"\[env: (\w+)=", s):
            current["env"] = env.group(1)
        elif s == "Possible values:":
            in_list, current["choices"] = True, []
        elif in_list and (item := re.match(r"- ([\w.-]+):", s)):
            current["choices"].append(item.group(1))
        elif in_list and not s.startswith("- "):
            in_list = False
    return out


def cross_check(options: list[Option_], documented: dict[str, dict[str, Any]]) -> list[str]:
    """Every disagreement between the struct's reading and launcher.md, as sentences (none: agreed)."""
    problems = []
    names = [o.name for o in options]
    for missing in sorted(set(documented) - set(names)):
        problems.append(f"launcher.md has --{missing}, the struct reading has not")
    for o in options:
        d = documented.get(o.name)
        if d is None:
            if not o.hidden:
                problems.append(f"the struct has --{o.name}, launcher.md has not")
            continue
        for key in ("takes_value", "short", "env"):
            if getattr(o, key) != d[key]:
                problems.append(f"--{o.name}: {key} {getattr(o, key)!r} in main.rs, {d[key]!r} in launcher.md")
        if (o.choices or None) != (d["choices"] or None):
            problems.append(f"--{o.name}: choices {o.choices} in main.rs, {d['choices']} in launcher.md")
    return problems


# ----- output ---------------------------------------------------------------------------------


def render(version: str, tag: str, commit: str, commit_date: str, cargo_version: str | None,
           options: list[Option_], *, date: str) -> str:
    import yaml

    header = [
        f"Flags of `text-generation-launcher` in Hugging Face TGI {version}, read by tools/dump_tgi_flags.py from the",
        f"clap `Args` struct in {MAIN_RS} at the tag {tag} (commit {commit}, {commit_date}) and",
        f"cross-checked option by option against {LAUNCHER_MD} at the same commit (the launcher's own --help",
        "output): names, short aliases, takes_value, possible values and env variables all agree.",
        f"Regenerate, do not edit: python tools/dump_tgi_flags.py --git-dir <clone> --tag {tag}",
        f"{len(options)} long options, {sum(o.deprecated for o in options)} marked deprecated. takes_value: false for bool switches;",
        "Option<bool> takes true|false; choices are the ValueEnum values clap accepts; repeatable: a Vec field.",
    ]
    if cargo_version and cargo_version != version:
        header.append(f"Cargo.toml at {tag} says version {cargo_version}: that is what `--version` prints in this build.")
    data = {
        "tool": "tgi", "command": "text-generation-launcher", "version": version, "date": date,
        "sources": [f"{GITHUB}/blob/{tag}/{MAIN_RS}", f"{GITHUB}/blob/{tag}/{LAUNCHER_MD}",
                    f"{GITHUB}/blob/{commit}/{MAIN_RS}", f"{GITHUB}/blob/{commit}/{LAUNCHER_MD}"],
        "commit": commit, "cargo_version": cargo_version,
        "generated_by": "tools/dump_tgi_flags.py",
        "flags": {o.name: o.as_yaml() for o in options},
    }
    return "".join(f"# {h}\n" for h in header) + yaml.safe_dump(data, sort_keys=False, default_flow_style=None, width=120)


def _git(git_dir: str, *args: str) -> str:
    return subprocess.run(["git", "--git-dir", git_dir, *args], check=True, capture_output=True, text=True).stdout


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tag", required=True, help="the release tag, e.g. v3.3.7")
    p.add_argument("--git-dir", help="a clone (or bare mirror) of huggingface/text-generation-inference holding the tag")
    p.add_argument("--main-rs", type=Path, help="without --git-dir: launcher/src/main.rs at the tag")
    p.add_argument("--launcher-md", type=Path, help="without --git-dir: docs/source/reference/launcher.md at the tag")
    p.add_argument("--commit", help="without --git-dir: the tag's commit")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    version = args.tag.removeprefix("v")
    cargo_version = None
    if args.git_dir:
        commit = _git(args.git_dir, "rev-parse", f"{args.tag}^{{commit}}").strip()
        commit_date = _git(args.git_dir, "log", "-1", "--format=%cs", commit).strip()
        rust = _git(args.git_dir, "show", f"{commit}:{MAIN_RS}")
        md = _git(args.git_dir, "show", f"{commit}:{LAUNCHER_MD}")
        cargo = re.search(r'^version\s*=\s*"([^"]+)"', _git(args.git_dir, "show", f"{commit}:Cargo.toml"), re.M)
        cargo_version = cargo.group(1) if cargo else None
    else:
        if not (args.main_rs and args.launcher_md and args.commit):
            p.error("give --git-dir, or --main-rs, --launcher-md and --commit")
        commit, commit_date = args.commit, "date not read"
        rust, md = args.main_rs.read_text(), args.launcher_md.read_text()
    options = parse_args_struct(rust, parse_value_enums(rust))
    problems = cross_check(options, parse_launcher_md(md))
    if problems:
        print("main.rs and launcher.md disagree:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    out = args.out or FLAGS_DIR / f"tgi-{version}.yaml"
    out.write_text(render(version, args.tag, commit, commit_date, cargo_version, options, date=_dt.date.today().isoformat()))
    print(f"{out}: {len(options)} options, agreed with launcher.md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
