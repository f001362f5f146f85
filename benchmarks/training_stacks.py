"""Training per stack against published measurements (issue: training per stack): for every row
of tests/data/training_stacks/<stack>.yaml with a complete `case:`, the predicted peak memory
(the caching allocator's reserved peak where the source printed reserved or nvidia-smi memory,
the allocated total where it printed torch.cuda.max_memory_allocated) and tokens/s against what
was measured. Prints a Markdown table per stack and the mean and max |error|. Run from the
repository root:

    python benchmarks/training_stacks.py

A case names a bundled model (`model:`) or, for a model shardplan does not bundle, gives its
shape (`model: null` and a `shape:` block, translated as a Hugging Face config of the family it
names; see `_shape_config`). A row is skipped (and listed) when its case lacks the model, the GPU
profile, the batch or the sequence length; its measured figures stay in the data file with their
sources. Measured throughput is read as printed: tokens/s per GPU or for all GPUs, samples/s for
all GPUs, or the time of one optimizer step over the case's global batch; where the source
printed only a TFLOP/s figure, the row's numeric `inferred.tokens_per_s_per_gpu` (the source's own
FLOP formula inverted, shown in the row) is used. Not modelled yet, so rows that use them say so
in their error: fp8 training GEMMs, torch.compile, and torchtitan's unsharded parameters under
pipeline parallelism.
"""

from __future__ import annotations

import re
import statistics
import sys
from pathlib import Path

import yaml

from shardplan.cost.estimate import estimate
from shardplan.cost.inputs import training_workload
from shardplan.cost.layout import Layout, PipelineSchedule, Recompute
from shardplan.errors import ShardplanError
from shardplan.knowledge.load import stack_rules
from shardplan.specs.cluster import cluster
from shardplan.specs.loading import load_hardware, load_model, model_from_data
from shardplan.specs.model import ModelSpec

DATA = Path(__file__).resolve().parent.parent / "tests" / "data" / "training_stacks"
GIB = 2**30


def _memory_gib(measured: dict) -> tuple[float | None, str]:
    for key, scale in (("peak_memory_gib", 1.0), ("peak_memory_mib", 1 / 1024), ("memory_gib", 1.0),
                       ("mem_max_allocated_bytes", 1 / 2**30)):
        if isinstance(measured.get(key), (int, float)):
            counter = str(measured.get("memory_counter", ""))
            return measured[key] * scale, "allocated" if "allocated" in counter else "reserved"
    return None, ""


def _tokens_per_gpu(r: dict) -> float | None:
    """Measured tokens/s per GPU from whichever throughput figure the source printed; the case's
    seq_len, global_batch and gpus convert samples/s and step times (one step = the global batch)."""
    measured, c = r.get("measured") or {}, r["case"]
    gpus, seq = c["gpus"], c["seq_len"]

    def number(key: str, d: dict = measured) -> float | None:
        return float(d[key]) if isinstance(d.get(key), (int, float)) else None

    if (v := number("tokens_per_s_per_gpu")) is not None:
        return v
    if (v := number("tokens_per_s_all_gpus")) is not None:
        return v / gpus
    if (v := number("samples_per_s_all_gpus")) is not None:
        return v * seq / gpus
    if (v := number("step_time_s")) is not None:
        return (c.get("global_batch") or gpus * c["micro_batch"]) * seq / gpus / v
    inferred = r.get("inferred") or {}
    if isinstance(inferred.get("tokens_per_s_per_gpu"), str):  # "inferred: <how> = N": the N
        m = re.search(r"=\s*([0-9][0-9,]*(?:\.[0-9]+)?)\s*$", inferred["tokens_per_s_per_gpu"])
        return float(m.group(1).replace(",", "")) if m else None
    return number("tokens_per_s_per_gpu", inferred)


# `shape:` keys -> the Hugging Face config keys of each family's translator (shardplan/specs/hf.py).
_FAMILY_KEYS = {
    "gpt2": {"layers": "n_layer", "hidden": "n_embd", "heads": "n_head", "ffn": "n_inner", "vocab": "vocab_size",
             "max_positions": "n_positions", "activation": "activation_function",
             "tied_embeddings": "tie_word_embeddings"},
    "falcon": {"layers": "num_hidden_layers", "hidden": "hidden_size", "heads": "num_attention_heads",
               "ffn": "ffn_hidden_size", "vocab": "vocab_size", "max_positions": "max_position_embeddings",
               "activation": "activation", "tied_embeddings": "tie_word_embeddings", "bias": "bias"},
}
_LLAMA_KEYS = {"layers": "num_hidden_layers", "hidden": "hidden_size", "heads": "num_attention_heads",
               "kv_heads": "num_key_value_heads", "ffn": "intermediate_size", "vocab": "vocab_size",
               "head_dim": "head_dim", "max_positions": "max_position_embeddings", "activation": "hidden_act",
               "tied_embeddings": "tie_word_embeddings", "bias": "attention_bias"}
_SHAPE_KEYS = {"layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "gated_mlp", "family", "head_dim",
               "max_positions", "activation", "tied_embeddings", "bias", "positions", "overrides", "notes"}


def _shape_config(shape: dict) -> dict:
    """A Hugging Face config dict for a `shape:` block, so that the model goes through the same
    translator as a config.json. `family` picks the layout (default: llama for a gated MLP; gpt2 --
    LayerNorm, learned positions, biases everywhere, plain MLP -- otherwise; falcon with
    `positions: alibi` is BLOOM's layout: LayerNorm, ALiBi, biases, sequential residual);
    llama/qwen2/gemma take kv_heads, head_dim and `bias` (q/k/v/o bias; qwen2 has q/k/v bias only).
    What no family expresses goes in `overrides:`, ModelSpec fields set after the translation."""
    unknown = set(shape) - _SHAPE_KEYS
    if unknown:
        raise ValueError(f"shape: unknown keys {sorted(unknown)}")
    positions = shape.get("positions")
    family = shape.get("family") or ("llama" if shape.get("gated_mlp") else
                                     "falcon" if positions == "alibi" else "gpt2")
    gated = family in ("llama", "qwen2", "gemma")
    if bool(shape.get("gated_mlp", gated)) != gated and "mlp_gated" not in (shape.get("overrides") or {}):
        raise ValueError(f"shape: gated_mlp {shape.get('gated_mlp')} does not fit family {family}")
    if family in ("gpt2", "falcon") and shape.get("kv_heads", shape["heads"]) != shape["heads"]:
        raise ValueError(f"shape: family {family} has no grouped-query attention; give family llama and "
                         "overrides such as {mlp_gated: false, norm_type: layernorm, mlp_bias: true}")
    keys = _FAMILY_KEYS.get(family, _LLAMA_KEYS)
    cfg = {"model_type": family, **{keys[k]: v for k, v in shape.items() if k in keys and v is not None}}
    if family == "falcon":
        cfg.update(alibi=positions == "alibi", parallel_attn=False, multi_query=False,
                   new_decoder_architecture=False, bias=shape.get("bias", True))
    return cfg


def _spec(r: dict) -> ModelSpec:
    c = r["case"]
    if isinstance(c.get("model"), str):
        return load_model(c["model"]).spec
    shape = c["shape"]
    spec = model_from_data(_shape_config(shape), f"{DATA.name}/{r['id']}", r["id"]).spec
    if shape.get("overrides"):
        spec = ModelSpec.model_validate({**spec.model_dump(), **shape["overrides"]})
    return spec


def _compiled(value) -> bool:
    """torch_compile as the rows write it: a bool, or text such as "true (inductor)" or "regional
    compilation (...)"; "not stated" and "false" are eager."""
    if isinstance(value, bool):
        return value
    text = str(value or "").lower()
    return text.startswith("true") or ("compil" in text and not text.startswith(("false", "no", "not")))


def predict(stack: str, r: dict):
    """The estimate for one row's `case:`; None when the case lacks what a prediction needs.
    Raises ShardplanError or ValueError for a case the model refuses."""
    c = r.get("case") or {}
    model, hardware = c.get("model"), c.get("hardware") or c.get("closest_hardware_profile") or r.get(
        "closest_hardware_profile")
    has_model = isinstance(model, str) or (model is None and isinstance(c.get("shape"), dict))
    if not (has_model and hardware and c.get("gpus") and c.get("micro_batch") and c.get("seq_len")):
        return None
    spec = _spec(r)
    hw = cluster(load_hardware(hardware), gpus=c["gpus"], nodes=None, gpus_per_node=None)
    tp, pp, cp = c.get("tp") or 1, c.get("pp") or 1, c.get("cp") or 1
    dp = c.get("dp") or c["gpus"] // (tp * pp * cp)
    vp = c.get("vp") or 1
    layout = Layout(tp=tp, pp=pp, dp=dp, cp=cp, ep=c.get("ep") or 1, zero_stage=c.get("zero_stage") or 0,
                    micro_batch_size=c["micro_batch"], recompute=Recompute(c.get("recompute") or "none"),
                    sequence_parallel=tp > 1 and (c["sequence_parallel"] if isinstance(c.get("sequence_parallel"), bool)
                                                  else stack in ("torchtitan", "megatron")), virtual_stages=vp,
                    pp_schedule=PipelineSchedule.INTERLEAVED if vp > 1 else PipelineSchedule.ONE_F_ONE_B,
                    pp_embedding_as_layer=bool(c.get("pp_embedding_as_layer")),
                    pp_loss_as_layer=bool(c.get("pp_loss_as_layer")))
    wl = training_workload(seq_len=c["seq_len"], global_batch_size=c.get("global_batch") or dp * c["micro_batch"],
                           optimizer="adamw", framework=None, flash_attention=c.get("flash_attention"),
                           dropout=bool(c.get("dropout")), stack=stack_rules(stack),
                           compile=_compiled(r.get("torch_compile")),
                           matmul_dtype="fp8" if c.get("dtype") == "fp8" else None,
                           tp_comm_overlap=bool(c.get("tp_comm_overlap")),
                           compile_loss=c.get("compile_loss"))
    return estimate(spec, hw, layout, wl)


def evaluate(stack: str, rows: list[dict]) -> tuple[list[tuple], list[str]]:
    out, skipped = [], []
    for r in rows:
        try:
            rep = predict(stack, r)
        except (ShardplanError, ValueError) as e:
            skipped.append(f"{r['id']} ({e})")
            continue
        if rep is None:
            skipped.append(r["id"])
            continue
        m = r.get("measured") or {}
        mem, counter = _memory_gib(m)
        rank = max(rep.memory.per_rank, key=lambda x: x.reserved_bytes)
        predicted_mem = (rank.reserved_bytes if counter == "reserved" else rank.per_gpu_bytes["total"]) / GIB
        tps = _tokens_per_gpu(r)
        out.append((r["id"], mem, predicted_mem, counter, tps, rep.time.tokens_per_second_per_gpu))
    return out, skipped


def main() -> int:
    for path in sorted(DATA.glob("*.yaml")):
        stack = path.stem
        rows, skipped = evaluate(stack, yaml.safe_load(path.read_text())["rows"])
        print(f"\n### {stack}\n\n| row | memory measured | predicted | error | tokens/s/GPU measured | predicted | error |")
        print("|---|---|---|---|---|---|---|")
        mem_err, tps_err = [], []
        for rid, mem, pmem, counter, tps, ptps in rows:
            me = f"{pmem / mem - 1:+.0%}" if mem else ""
            te = f"{ptps / tps - 1:+.0%}" if tps else ""
            if mem:
                mem_err.append(abs(pmem / mem - 1))
            if tps:
                tps_err.append(abs(ptps / tps - 1))
            print(f"| {rid} | {f'{mem:.1f} GiB ({counter})' if mem else ''} | {pmem:.1f} GiB | {me} | "
                  f"{f'{tps:,.0f}' if tps else ''} | {ptps:,.0f} | {te} |")
        for what, errs in (("memory", mem_err), ("tokens/s", tps_err)):
            if errs:
                print(f"\n{what}: {len(errs)} rows, mean |error| {statistics.mean(errs):.0%}, max {max(errs):.0%}, "
                      f"within 10%: {sum(e <= 0.10 for e in errs)}")
        if skipped:
            print(f"\nskipped ({len(skipped)}): " + ", ".join(skipped))
    return 0


if __name__ == "__main__":
    sys.exit(main())
