"""Write shardplan/exporters/flags/llamacpp-<tag>.yaml: the options of llama.cpp's `llama-server`
at a pinned release tag, from the server's own `--help` (or, as a fallback, its argument table).

    # the way the bundled list was made: a CPU build of the tag's source, no network (2 cores: ~15 min)
    cmake -B build -DGGML_NATIVE=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF \\
          -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DCMAKE_BUILD_TYPE=Release
    cmake --build build --target llama-server -j2
    python tools/dump_llamacpp_flags.py --binary build/bin/llama-server --arg-cpp common/arg.cpp \\
        --tag b11312 --commit 0c1e57098bba43ac29e6e3b677cdceebdd22334f --origin "where the source came from"
    # fallback, no build: read the argument table (common/arg.cpp) only
    python tools/dump_llamacpp_flags.py --arg-cpp common/arg.cpp --tag b11312 --commit ...

The bundled llamacpp-b11312.yaml was made that way (a build, --help parsed, cross-checked with
the source's table: they agree). Its source code is the `vendor/llama.cpp` folder of the
llama-cpp-python 0.3.36 sdist on PyPI (`pip download --no-deps --no-binary :all:
llama-cpp-python==0.3.36`; its CHANGELOG: "update llama.cpp to ggml-org/llama.cpp@0c1e57098"),
because GitHub is out of this project's reach; 0c1e57098 is the commit of release tag b11312.

llama.cpp defines every option of every tool in one table, `common_params_parser_init` in
common/arg.cpp: `add_opt(common_arg({"-ngl", "--gpu-layers", "--n-gpu-layers"}, "N", "help",
handler).set_env("LLAMA_ARG_N_GPU_LAYERS"))`, with `.set_examples({LLAMA_EXAMPLE_SERVER, ...})`
naming the tools it applies to. An option without set_examples keeps the default
`examples = {LLAMA_EXAMPLE_COMMON}` (common/arg.h), and `add_opt` keeps an option for a tool when
`in_example(ex) || in_example(LLAMA_EXAMPLE_COMMON)` and not `is_exclude(ex)`: so llama-server takes
every COMMON option and those tagged SERVER. Which constructor an option uses says whether it takes
a value: (names, help, handler) is a switch; (names, negated names, help, handler) a switch with
its `--no-` form; (names, VALUE, help, handler) takes one value; two value hints take two.

`--binary` (the trusted way) parses `llama-server --help`: an option line starts with '-' at
column 0 and lists its spellings and value hint; its help follows from column 40
(`common_arg::to_string`). Choices are taken where the help states them: a hint `{a,b}` or
`[a|b]`, or "allowed values: a, b" (the parser may accept synonyms, e.g. on/true/1 for
--flash-attn; exports keep to the listed ones). `--arg-cpp` alone reads the table with a small C++
tokenizer instead; it cannot evaluate `#ifdef` blocks or `if (ex == ...)` branches (it keeps
every option it sees), which is why the binary's own help is preferred. (At b11312 no option of the
table sits under an #if, so a CPU build lists the options a CUDA build has.) With both, the tool
checks that they agree on names and on taking a value, and takes the count of values from the
source (the help cannot tell a two-word hint from two values).

The YAML keys are the long (`--`) spellings without dashes, as `exporters.base.flag_table` reads
them, each with takes_value, metavar, choices, aliases (the other spellings of the same option),
negates (for a `--no-x` form), env (the LLAMA_ARG_* variable), and deprecated/note where the help
says so. No llama.cpp code is copied into the repository: only option names and those facts.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

REPO = Path(__file__).resolve().parents[1]
FLAGS_DIR = REPO / "shardplan" / "exporters" / "flags"
HELP_COLUMN = 40  # common_arg::to_string: n_leading_spaces
EXAMPLE = "LLAMA_EXAMPLE_SERVER"


@dataclass
class Option:
    """One common_arg: every spelling, its value hint(s) and help."""

    names: list[str]  # as written: "-ngl", "--gpu-layers", "--n-gpu-layers", then the negated ones
    negated: list[str] = field(default_factory=list)  # the subset of names that switch it off
    metavar: str | None = None
    num_values: int = 0  # 0: a switch
    help: str = ""
    env: str | None = None

    @property
    def long_names(self) -> list[str]:
        return [n for n in self.names if n.startswith("--")]


# ----- llama-server --help -----------------------------------------------------------------

_ENV = re.compile(r"\(env: ([A-Z0-9_]+)\)")


def parse_help(text: str) -> list[Option]:
    """The options of a llama.cpp tool's --help output (common_arg::to_string layout)."""
    out: list[Option] = []
    for line in text.splitlines():
        if line.startswith("-----"):  # a section title: "----- common params -----"
            continue
        if line.startswith("-"):
            if len(line) > HELP_COLUMN and line[HELP_COLUMN - 3:HELP_COLUMN] == "   ":
                head, first = line[:HELP_COLUMN].rstrip(), line[HELP_COLUMN:].strip()
            else:  # spellings and hint too long: the help starts on the next line
                head, first = line.rstrip(), ""
            out.append(_option_from_head(head, first))
        elif out and line.startswith(" " * HELP_COLUMN):
            out[-1].help += ("\n" if out[-1].help else "") + line.strip()
        elif line.strip() and out:
            out[-1].help += ("\n" if out[-1].help else "") + line.strip()
    for o in out:
        env = _ENV.search(o.help)
        o.env = env.group(1) if env else None
    return out


def _option_from_head(head: str, first_help: str) -> Option:
    """'-ngl, --gpu-layers, --n-gpu-layers N' -> names and hint. Spellings are joined by ', ';
    the last one is followed by ' HINT' when the option takes a value."""
    parts = head.split(", ")
    last = parts[-1].strip()
    name, _, hint = last.partition(" ")
    names = [p.strip() for p in parts[:-1]] + [name]
    opt = Option(names=names, metavar=hint.strip() or None, help=first_help)
    opt.num_values = 1 if opt.metavar else 0
    opt.negated = negated_names(names) if not opt.metavar else []
    return opt


def negated_names(names: list[str]) -> list[str]:
    """The `--no-x` / `-no-x` spellings whose positive form is among the option's names."""
    bare = {n.lstrip("-") for n in names}
    return [n for n in names if n.lstrip("-").startswith("no-") and n.lstrip("-")[3:] in bare]


# ----- common/arg.cpp ------------------------------------------------------------------------


def _skip_literal(src: str, i: int) -> int:
    """Index after the string/char literal or comment starting at i, else i."""
    if src.startswith("//", i):
        j = src.find("\n", i)
        return len(src) if j < 0 else j
    if src.startswith("/*", i):
        j = src.find("*/", i + 2)
        return len(src) if j < 0 else j + 2
    if src.startswith('R"', i):  # raw string R"delim( ... )delim"
        m = re.match(r'R"([^(\s]*)\(', src[i:])
        if m:
            end = src.find(f'){m.group(1)}"', i + m.end())
            return len(src) if end < 0 else end + len(m.group(1)) + 2
    if src[i] in "\"'":
        q, j = src[i], i + 1
        while j < len(src) and src[j] != q:
            j += 2 if src[j] == "\\" else 1
        return j + 1
    return i


def _matching(src: str, i: int) -> int:
    """Index of the bracket closing the one at i (literals and comments skipped)."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack = [pairs[src[i]]]
    j = i + 1
    while j < len(src):
        k = _skip_literal(src, j)
        if k != j:
            j = k
            continue
        c = src[j]
        if c in pairs:
            stack.append(pairs[c])
        elif c in ")}]":
            if c != stack.pop():
                raise ValueError(f"unbalanced {c!r} at {j}")
            if not stack:
                return j
        j += 1
    raise ValueError(f"no bracket closes the one at {i}")


def _split_top(src: str) -> list[str]:
    """A call's arguments, split at the commas outside brackets and literals."""
    out, start, depth, j = [], 0, 0, 0
    while j < len(src):
        k = _skip_literal(src, j)
        if k != j:
            j = k
            continue
        c = src[j]
        if c in "({[":
            depth += 1
        elif c in ")}]":
            depth -= 1
        elif c == "," and depth == 0:
            out.append(src[start:j].strip())
            start = j + 1
        j += 1
    if src[start:].strip():
        out.append(src[start:].strip())
    return out


_STRING = re.compile(r'"((?:[^"\\]|\\.)*)"')


def _strings(expr: str) -> list[str]:
    return [bytes(s, "utf-8").decode("unicode_escape") for s in _STRING.findall(expr)]


def _is_string_list(expr: str) -> bool:
    return expr.startswith("{") and expr.endswith("}") and all(
        p.startswith('"') for p in _split_top(expr[1:-1]))


_STATIC_LIST = re.compile(r"static\s+std::initializer_list<enum\s+llama_example>\s+(\w+)\s*=\s*\{([^}]*)\}")
_EXAMPLE_NAME = re.compile(r"LLAMA_EXAMPLE_\w+")


@dataclass
class SourceOption(Option):
    examples: set[str] = field(default_factory=lambda: {"LLAMA_EXAMPLE_COMMON"})
    excludes: set[str] = field(default_factory=set)
    preset_only: bool = False

    def in_tool(self, example: str) -> bool:
        """add_opt's rule (common/arg.cpp common_params_parser_init)."""
        return ((example in self.examples or "LLAMA_EXAMPLE_COMMON" in self.examples)
                and example not in self.excludes and not self.preset_only)


def parse_arg_cpp(src: str) -> list[SourceOption]:
    """Every `add_opt(common_arg(...)...)` of the source, with its examples, excludes and env."""
    lists = {m.group(1): set(_EXAMPLE_NAME.findall(m.group(2))) for m in _STATIC_LIST.finditer(src)}
    out: list[SourceOption] = []
    for m in re.finditer(r"add_opt\(\s*common_arg\s*\(", src):
        open_call = m.end() - 1
        close_call = _matching(src, open_call)
        args = _split_top(src[open_call + 1:close_call])
        end_add = _matching(src, m.start() + len("add_opt"))
        chain = src[close_call + 1:end_add]
        out.append(_source_option(args, chain, lists))
    return out


def _source_option(args: list[str], chain: str, lists: dict[str, set[str]]) -> SourceOption:
    names = _strings(args[0])
    negated: list[str] = []
    hints: list[str] = []
    rest = args[1:]
    if rest and _is_string_list(rest[0]):  # (names, negated names, help, handler)
        negated = _strings(rest[0])
        rest = rest[1:]
    else:
        # C++ picks the constructor by the count: (names, help, handler) is a switch; (names, HINT,
        # help, handler) takes a value; (names, HINT, HINT2, help, handler) two. A hint may be an
        # expression (--spec-type's is common_speculative_all_types_str()): "VALUE" stands for it.
        for expr in rest[:-2]:
            literal = re.fullmatch(r'"(?:[^"\\]|\\.)*"', expr)
            hints.append(_strings(expr)[0] if literal else "VALUE")
        rest = rest[-2:]
    opt = SourceOption(names=names + negated, negated=negated, metavar=" ".join(hints) or None,
                       num_values=len(hints), help=" ".join(_strings(rest[0])) if rest else "")
    for call in re.finditer(r"\.(set_examples|set_excludes|set_env|set_preset_only)\s*\(", chain):
        body = chain[call.end():_matching(chain, call.end() - 1)].strip()
        if call.group(1) == "set_env":
            opt.env = (_strings(body) or [None])[0]
        elif call.group(1) == "set_preset_only":
            opt.preset_only = True
        else:
            found = set(_EXAMPLE_NAME.findall(body)) if body.startswith("{") else lists.get(body, set())
            if call.group(1) == "set_examples":
                opt.examples = found
            else:
                opt.excludes = found
    return opt


# ----- the flag list ---------------------------------------------------------------------------

_CHOICE_HINT = re.compile(r"^(?:\{([^{}]+)\}|\[([^\[\]]+)\]|<([^<>]+)>)$")
_ALLOWED = re.compile(r"allowed values:\s*([^\n(]+)")
_DEPRECATED = re.compile(r"\bdeprecated\b", re.I)


def choices_of(opt: Option) -> list[str] | None:
    """The values the help lists: a {a,b} / [a|b] / <a|b> hint, or 'allowed values: a, b'. A value
    of the wrong form fails at start (e.g. "error: unknown value for --flash-attn")."""
    if opt.metavar:
        m = _CHOICE_HINT.match(opt.metavar)
        if m:  # {a,b,c}, [a|b], <a|b>; not <dev1,dev2,..>, which shows the form of one value
            braces, other = m.group(1), m.group(2) or m.group(3)
            values = [v.strip() for v in (braces.split(",") if braces else other.split("|") if "|" in other else [])]
            if len(values) > 1 and all(re.fullmatch(r"[A-Za-z0-9_.+-]+", v) for v in values):
                return values
    allowed = _ALLOWED.search(opt.help)
    if allowed:
        values = [v.strip() for v in allowed.group(1).split(",") if v.strip()]
        if values and all(re.fullmatch(r"[A-Za-z0-9_.+-]+", v) for v in values):
            return values
    return None


def flag_entries(options: Iterable[Option]) -> dict[str, dict[str, Any]]:
    """YAML entries keyed by long name without dashes (first definition wins), sorted."""
    out: dict[str, dict[str, Any]] = {}
    for opt in options:
        for name in opt.long_names:
            key = name[2:]
            if key in out:
                continue
            entry: dict[str, Any] = {"takes_value": opt.num_values > 0}
            if opt.num_values > 1:
                entry["num_values"] = opt.num_values
            if opt.metavar:
                entry["metavar"] = opt.metavar
            ch = choices_of(opt)
            if ch:
                entry["choices"] = ch
            if name in opt.negated:
                entry["negates"] = next(n for n in opt.names if n not in opt.negated and n.startswith("--"))[2:]
            aliases = [n for n in opt.names if n != name and (n in opt.negated) == (name in opt.negated)]
            if aliases:
                entry["aliases"] = aliases
            if opt.env:
                entry["env"] = opt.env
            if _DEPRECATED.search(opt.help):
                entry["deprecated"] = True
                entry["note"] = " ".join(opt.help.split())[:200]
            out[key] = entry
    return dict(sorted(out.items()))


def compare(help_opts: list[Option], source_opts: list[Option]) -> list[str]:
    """Where the binary's help and the source's table disagree (names, taking a value)."""
    h, s = flag_entries(help_opts), flag_entries(source_opts)
    problems = [f"--{n}: only in --help" for n in sorted(set(h) - set(s))]
    problems += [f"--{n}: only in the source" for n in sorted(set(s) - set(h))]
    problems += [f"--{n}: takes_value {h[n]['takes_value']} in --help, {s[n]['takes_value']} in the source"
                 for n in sorted(set(h) & set(s)) if h[n]["takes_value"] != s[n]["takes_value"]]
    return problems


def with_source_counts(help_opts: list[Option], source_opts: list[Option]) -> list[Option]:
    """The help's options with the number of values the source gives each (2 for two hints)."""
    counts = {n: o.num_values for o in source_opts for n in o.names}
    for o in help_opts:
        if o.num_values and counts.get(o.names[0], 1) > 1:
            o.num_values = counts[o.names[0]]
    return help_opts


def render(flags: dict[str, dict[str, Any]], *, tag: str, commit: str, method: str, origin: str,
           version_line: str | None, date: str, cross_check: str | None) -> str:
    import yaml

    header = [
        f"Options of llama.cpp's `llama-server` at release tag {tag} (commit {commit}), written by "
        f"tools/dump_llamacpp_flags.py. Method: {method}.",
        f"Source code: {origin}.",
        *([f"The binary said: {version_line}"] if version_line else []),
        *([cross_check] if cross_check else []),
        f"{len(flags)} long options. takes_value: false for switches; negates: the switch a --no-x form turns off;",
        "aliases: the option's other spellings (short ones are not keys); choices: as the help lists them (the",
        "parser may also take synonyms: on/true/1 for on|off values); env: the LLAMA_ARG_* variable that sets it.",
        "llama.cpp has no positional arguments, and it reads a `--x_y` spelling as `--x-y`.",
    ]
    data = {
        "tool": "llamacpp", "command": "llama-server", "version": tag, "date": date, "commit": commit,
        "method": method,
        "sources": [f"https://github.com/ggml-org/llama.cpp/releases/tag/{tag}",
                    f"https://github.com/ggml-org/llama.cpp/blob/{commit}/common/arg.cpp",
                    f"https://github.com/ggml-org/llama.cpp/blob/{commit}/tools/server/README.md"],
        "flags": flags,
    }
    body = yaml.safe_dump(data, sort_keys=False, default_flow_style=None, width=120, allow_unicode=True)
    wrapped = [w for h in header for w in textwrap.wrap(h, 110, break_on_hyphens=False)]
    return "".join(f"# {w}\n" for w in wrapped) + body


def run_help(binary: Path) -> tuple[str, str | None]:
    """`llama-server --help` (exit 0) and the first line of `--version`."""
    res = subprocess.run([str(binary), "--help"], capture_output=True, text=True, timeout=120)
    if res.returncode != 0 or "--gpu-layers" not in res.stdout:
        raise SystemExit(f"error: {binary} --help failed ({res.returncode}):\n{res.stderr[-2000:]}")
    ver = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    line = next((x for x in (ver.stdout + ver.stderr).splitlines() if x.startswith("version")), None)
    return res.stdout, line


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--binary", type=Path, help="a llama-server built from the tag's source (preferred)")
    p.add_argument("--arg-cpp", type=Path, help="the tag's common/arg.cpp (fallback, or cross-check with --binary)")
    p.add_argument("--tag", required=True, help="release tag, e.g. b11312")
    p.add_argument("--commit", required=True, help="the tag's full commit hash")
    p.add_argument("--origin", default="a checkout of the tag", help="where the source came from, for the header")
    p.add_argument("--out", type=Path, default=None, help="default: shardplan/exporters/flags/llamacpp-<tag>.yaml")
    args = p.parse_args(argv)
    if args.binary is None and args.arg_cpp is None:
        p.error("give --binary, --arg-cpp or both")
    source = None
    if args.arg_cpp is not None:
        source = [o for o in parse_arg_cpp(args.arg_cpp.read_text()) if o.in_tool(EXAMPLE)]
    cross = version_line = None
    if args.binary is not None:
        text, version_line = run_help(args.binary)
        options = parse_help(text)
        method = "`llama-server --help` of a CPU build of the tag's source, parsed"
        if source is not None:
            problems = compare(options, source)
            for line in problems:
                print(f"mismatch: {line}", file=sys.stderr)
            options = with_source_counts(options, source)
            cross = (f"Cross-checked against the argument table in common/arg.cpp: "
                     f"{'no difference' if not problems else '; '.join(problems)}.")
    else:
        assert source is not None
        options = source
        method = ("the argument table in common/arg.cpp read with a tokenizer (no build): every add_opt of "
                  "an option for LLAMA_EXAMPLE_SERVER or COMMON; #ifdef and if (ex == ...) branches not evaluated")
    flags = flag_entries(options)
    out = args.out or FLAGS_DIR / f"llamacpp-{args.tag}.yaml"
    out.write_text(render(flags, tag=args.tag, commit=args.commit, method=method, origin=args.origin,
                          version_line=version_line, date=_dt.date.today().isoformat(), cross_check=cross))
    print(f"{out}: {len(flags)} flags, {sum(bool(f.get('deprecated')) for f in flags.values())} deprecated",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
