"""TGI's launcher flags read from its clap struct (tools/dump_tgi_flags.py, issue 26): the reading of
a small fixture of clap derive, the cross-check against the --help page catching a misreading, and the
bundled lists' provenance (tag, commit, date)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest
import yaml

from shardplan.exporters.base import PINNED_VERSIONS, flag_table

REPO = Path(__file__).parents[2]


def _tool():
    spec = importlib.util.spec_from_file_location("dump_tgi_flags", REPO / "tools" / "dump_tgi_flags.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


dump = _tool()

RUST = '''
#[derive(Clone, Copy, Debug, ValueEnum, Deserialize)]
#[serde(rename_all = "kebab-case")]
enum Quantization {
    Awq,
    CompressedTensors,
    // #[deprecated(since = "1.1.0")]
    BitsandbytesNf4,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Dtype {
    Float16,
    #[clap(name = "bfloat16")]
    BFloat16,
}

/// App Configuration
#[derive(Parser, Debug)]
#[clap(author, version, about, long_about = None)]
struct Args {
    /// The model.
    #[clap(default_value = "bigscience/bloom-560m", long, env)]
    model_id: String,
    #[clap(long, env)]
    sharded: Option<bool>,
    #[clap(long, env, value_enum)]
    quantize: Option<Quantization>,
    #[clap(long, env, value_enum)]
    dtype: Option<Dtype>,
    #[clap(long, env, value_enum)]
    trust_remote_code: bool,
    #[clap(long, env, value_delimiter = ',')]
    cuda_graphs: Option<Vec<usize>>,
    #[clap(default_value = "3000", long, short, env)]
    port: u16,
    #[clap(long, short, action)]
    env: bool,
}
'''

MD = '''
## MODEL_ID
```shell
      --model-id <MODEL_ID>
          The model.

          [env: MODEL_ID=]
          [default: bigscience/bloom-560m]
```
## SHARDED
```shell
      --sharded <SHARDED>
          [env: SHARDED=]
          [possible values: true, false]
```
## QUANTIZE
```shell
      --quantize <QUANTIZE>
          Possible values:
          - awq:                4 bit
          - compressed-tensors: mixed
          - bitsandbytes-nf4:   4bit

          [env: QUANTIZE=]
```
## DTYPE
```shell
      --dtype <DTYPE>
          [env: DTYPE=]
          [possible values: float16, bfloat16]
```
## TRUST_REMOTE_CODE
```shell
      --trust-remote-code
          [env: TRUST_REMOTE_CODE=]
```
## CUDA_GRAPHS
```shell
      --cuda-graphs <CUDA_GRAPHS>
          [env: CUDA_GRAPHS=]
```
## PORT
```shell
  -p, --port <PORT>
          [env: PORT=]
```
## ENV
```shell
  -e, --env
          Display a lot of information
```
## HELP
```shell
  -h, --help
```
## VERSION
```shell
  -V, --version
```
'''


def test_the_struct_reading_follows_clap_derive():
    opts = {o.name: o for o in dump.parse_args_struct(RUST, dump.parse_value_enums(RUST))}
    assert list(opts) == ["model-id", "sharded", "quantize", "dtype", "trust-remote-code", "cuda-graphs", "port", "env",
                          "help", "version"]
    assert opts["quantize"].choices == ["awq", "compressed-tensors", "bitsandbytes-nf4"]
    assert opts["dtype"].choices == ["float16", "bfloat16"]  # #[clap(name = ...)] wins over kebab-case
    assert opts["sharded"].choices == ["true", "false"] and opts["sharded"].takes_value
    assert not opts["trust-remote-code"].takes_value  # a bool is a switch even with value_enum
    assert opts["cuda-graphs"].repeatable and opts["port"].short == "p" and opts["port"].env == "PORT"
    assert opts["env"].env is None and opts["env"].short == "e"


def test_the_reading_agrees_with_the_help_page_and_a_misreading_is_caught():
    opts = dump.parse_args_struct(RUST, dump.parse_value_enums(RUST))
    assert dump.cross_check(opts, dump.parse_launcher_md(MD)) == []
    wrong = MD.replace("[possible values: float16, bfloat16]", "[possible values: float16, bfloat16, float32]")
    assert any("--dtype: choices" in p for p in dump.cross_check(opts, dump.parse_launcher_md(wrong)))
    extra = MD + "\n```shell\n      --new-knob <NEW_KNOB>\n```\n"
    assert dump.cross_check(opts, dump.parse_launcher_md(extra)) == ["launcher.md has --new-knob, the struct reading has not"]


@pytest.mark.parametrize("version", ["3.2.0", "3.3.7"])
def test_the_bundled_tgi_lists_were_read_at_their_tags(version):
    path = REPO / "shardplan" / "exporters" / "flags" / f"tgi-{version}.yaml"
    data = yaml.safe_load(path.read_text())
    assert str(data["version"]) == version and re.fullmatch(r"\d{4}-\d\d-\d\d", str(data["date"]))
    assert re.fullmatch(r"[0-9a-f]{40}", data["commit"]) and data["generated_by"] == "tools/dump_tgi_flags.py"
    assert any(f"/blob/v{version}/launcher/src/main.rs" in s for s in data["sources"])
    assert any(f"/blob/{data['commit']}/docs/source/reference/launcher.md" in s for s in data["sources"])
    t = flag_table(f"tgi-{version}")
    assert t.flags["quantize"]["choices"][:2] == ["awq", "compressed-tensors"]
    assert ("prometheus-port" in t.flags) == (version == "3.3.7")  # PR #3187, first in 3.3.0


def test_tgi_is_pinned_to_its_last_release():
    assert PINNED_VERSIONS["tgi"] == "3.3.7" and flag_table("tgi").version == "3.3.7"
    assert len(flag_table("tgi").flags) == 56
