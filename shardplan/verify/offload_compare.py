"""`verify PLAN --checkpoint DIR` for a serving plan that holds decoder layers off the GPU
(`layout.offload_layers` at `layout.offload_params`, engine transformers): what is checked before
anything loads, what the plan predicts, and the comparison. Pure: no torch (the run is
`verify.offload_serving`).

What is compared, each within TOLERANCE of the plan:

- GPU resident weights: the plan's weights per GPU less the one streamed tensor it counts in
  flight (cost/offload.py `streamed_buffer_bytes`; transformers streams one tensor at a time) and
  less the rotary cos/sin cache (cost/memory_serving.py `rotary_cache_bytes`, vLLM's
  RotaryEmbedding): transformers' LlamaRotaryEmbedding keeps only `inv_freq` (rotary_dim / 2
  fp32 values) and computes cos/sin per forward, so the cache is not held. Measured: the bytes of
  the parameters and buffers left materialized on the GPU after dispatch.
- GPU peak weights while generating: the plan's weights per GPU less the rotary cache. Measured:
  the most parameter and buffer bytes materialized at once while accelerate's hooks bring
  offloaded tensors in.
- host (cpu) and disk (nvme) offload: the plan's `host_offload_bytes` / `nvme_offload_bytes`.
  Measured: accelerate's weights_map tensors in host memory; the .dat files in the offload folder.
  The target the plan does not use must hold 0 bytes.
- bytes moved per generated token: the offloaded layers as the plan holds them
  (`offload_memory(...).weights_held_bytes` less the embedding's share, which is a lookup, as
  `offload_pass_seconds` counts it). Measured: the bytes accelerate's AlignDevicesHook copies to
  the execution device, over all forwards of the generation, divided by the forwards (one per
  generated token).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from shardplan.errors import CannotVerify, ShardplanError
from shardplan.plan.schema import DeploymentManifest
from shardplan.specs.model import ModelSpec

TOLERANCE = 0.05  # each measured byte count within 5% of the plan's
ENGINE = "transformers"  # the engine whose offload accelerate's device_map carries out
# The GPU is stood in for by torch.device("cpu"): accelerate treats it as a device of its own,
# distinct from the "cpu" offload target (dispatch_model's main device is the first value that is
# not "cpu"/"disk"), so offloaded modules go through the same hooks as beside a GPU.
GPU_STAND_IN = "GPU 0 stood in by torch.device('cpu')"
# Structural fields the checkpoint's config.json must share with the plan's model.
MATCHED_FIELDS = ("hidden_size", "num_layers", "vocab_size", "num_attention_heads", "kv_heads", "intermediate_size",
                  "head_dim_resolved")
PROMPT_SEED = 7919  # the prompt's token ids: (1 + PROMPT_SEED * i) mod vocab, deterministic


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class OffloadQuantity(_Frozen):
    """One measured byte count against the plan's."""

    quantity: str = Field(description="gpu_resident_weights, gpu_peak_weights, host_offload, disk_offload, "
                                      "moved_per_token")
    device: str = Field(description="where the bytes are: gpu, cpu, disk, or host->gpu for what moves")
    measured_bytes: float = Field(description="bytes measured")
    predicted_bytes: float = Field(description="bytes the plan predicts")
    relative_error: float | None = Field(description="(measured - predicted) / predicted; null when predicted is 0")
    tolerance: float = Field(description="the largest |relative_error| that passes")
    ok: bool = Field(description="within tolerance (predicted 0: measured exactly 0)")
    measured_how: str = Field(description="what was measured")
    predicted_how: str = Field(description="how the prediction is read from the plan")


class OffloadNumerics(_Frozen):
    """Greedy tokens of the offloaded model against the same checkpoint loaded whole."""

    check: str = Field(description="what is compared")
    prompt_tokens: int = Field(description="tokens in the prompt")
    new_tokens: int = Field(description="tokens generated (max_new_tokens)")
    tokens: list[int] = Field(description="prompt and generated tokens, offloaded")
    reference_tokens: list[int] = Field(description="prompt and generated tokens, loaded whole")
    ok: bool = Field(description="the two are identical")


class OffloadVerifyReport(_Frozen):
    """`shardplan verify PLAN --checkpoint DIR` for an offloaded serving plan."""

    kind: Literal["offload_serving"] = "offload_serving"
    plan: str = Field(description="the plan file")
    checkpoint: str = Field(description="the checkpoint folder that was loaded")
    status: Literal["ok", "mismatch"] = Field(description="ok: every quantity and the numerics within tolerance")
    model: str = Field(description="the plan's model name")
    dtype: str = Field(description="the format the weights were loaded in (the plan's activation dtype)")
    offload_params: Literal["cpu", "nvme"] = Field(description="where the plan keeps the offloaded layers")
    offloaded_layers: list[int] = Field(description="decoder layers the plan keeps off the GPU (cost/offload.py)")
    offloaded_modules: list[str] = Field(description="modules the exported device_map places on cpu or disk")
    device_map: dict[str, int | str] = Field(description="the accelerate exporter's device_map, as loaded")
    device: str = Field(description="what stood in for the GPU")
    forwards: int = Field(description="model forwards during the generation (one per generated token)")
    moved_bytes_total: float = Field(description="bytes the offload hooks copied to the GPU over all forwards")
    quantities: list[OffloadQuantity] = Field(description="measured against predicted, one per quantity")
    numerics: OffloadNumerics = Field(description="greedy tokens against the whole model's")
    notes: list[str] = Field(description="what the comparison assumes")
    mismatches: list[str] = Field(description="one sentence per quantity out of tolerance")


@dataclass(frozen=True)
class OffloadPrediction:
    """What the plan predicts, bytes; `*_how` says where each figure comes from."""

    gpu_weights_bytes: float  # the plan's weights per GPU (the stream buffer and rotary cache included)
    streamed_buffer_bytes: float  # one offloaded tensor in flight on the GPU
    rotary_cache_bytes: float  # the plan's cos/sin cache, which transformers does not hold
    host_bytes: float
    nvme_bytes: float
    moved_per_token_bytes: float  # the offloaded layers as held, the embedding's lookup share left out
    layers: tuple[int, ...]

    @property
    def gpu_resident_bytes(self) -> float:
        return self.gpu_weights_bytes - self.streamed_buffer_bytes - self.rotary_cache_bytes

    @property
    def gpu_peak_bytes(self) -> float:
        return self.gpu_weights_bytes - self.rotary_cache_bytes


@dataclass(frozen=True)
class OffloadMeasurement:
    """What the offloaded run measured (verify.offload_serving), bytes."""

    gpu_resident_bytes: float
    gpu_peak_bytes: float
    host_bytes: float
    disk_bytes: float
    moved_bytes_total: float
    forwards: int
    tokens: tuple[int, ...]
    reference_tokens: tuple[int, ...]

    @property
    def moved_per_token_bytes(self) -> float:
        return self.moved_bytes_total / self.forwards if self.forwards else 0.0


@dataclass(frozen=True)
class OffloadRun:
    """Everything the torch side needs, decided before it starts."""

    plan: str
    checkpoint: Path
    manifest: DeploymentManifest
    spec: ModelSpec
    device_map: dict[str, int | str]
    no_split_module_classes: tuple[str, ...]
    torch_dtype: str  # "bfloat16", "float16", "float32"
    offload_params: Literal["cpu", "nvme"]
    prompt: tuple[int, ...]
    new_tokens: int
    prediction: OffloadPrediction


# ----- checks before anything loads ----------------------------------------------------------


def check_offloaded_serving_plan(m: DeploymentManifest, plan: str) -> None:
    """Refuse (exit 2) what is not a serving plan that offloads decoder layers with transformers
    and accelerate, in a format verify loads."""
    L, wl = m.layout, m.workload
    if wl.kind != "inference":
        raise CannotVerify("--checkpoint verifies a serving plan; this one trains", source=plan, field="workload.kind",
                           hint="drop --checkpoint: verify runs training plans with torchrun")
    if L.offload_params not in ("cpu", "nvme") or L.offload_layers < 1:
        raise CannotVerify("--checkpoint verifies a plan that offloads decoder layers; this one offloads none",
                           source=plan, field="layout.offload_layers",
                           hint="plan with --engine transformers --offload all-cpu --offload-layers N")
    if wl.engine != ENGINE:
        raise CannotVerify(f"the plan is for {wl.engine}; --checkpoint runs transformers' offload (accelerate "
                           "device_map)", source=plan, field="workload.engine", hint="plan with --engine transformers")
    if wl.quantization != "none":
        raise CannotVerify(f"the plan's {wl.quantization} weights are not loaded by verify (it loads the checkpoint "
                           "16-bit)", source=plan, field="workload.quantization",
                           hint="verify a plan without --quantization")
    if L.tp > 1 or L.pp > 1 or L.dp > 1:
        raise CannotVerify(f"an offloaded plan on one GPU is verified; this one has tp={L.tp}, pp={L.pp}, dp={L.dp}",
                           source=plan, field="layout", hint="plan with --tp 1 --pp 1 on one GPU")


def checkpoint_spec(checkpoint: Path) -> ModelSpec:
    """The checkpoint folder's model, read from its config.json; the folder must also hold
    safetensors weights."""
    from shardplan.specs.loading import load_model

    where = str(checkpoint)
    if not checkpoint.is_dir():
        raise ShardplanError("no such checkpoint folder", source=where, field="--checkpoint",
                             hint="give a Hugging Face checkpoint folder (config.json and *.safetensors)")
    if not (checkpoint / "config.json").is_file():
        raise ShardplanError("the checkpoint folder has no config.json", source=where, field="--checkpoint",
                             hint="give a Hugging Face checkpoint folder (config.json and *.safetensors)")
    if not any(checkpoint.glob("*.safetensors")):
        raise ShardplanError("the checkpoint folder holds no *.safetensors weights", source=where, field="--checkpoint",
                             hint="save the model with save_pretrained(..., safe_serialization=True)")
    return load_model(str(checkpoint / "config.json")).spec


def _field(spec: ModelSpec, name: str) -> int:
    return spec.attention_head_dim if name == "head_dim_resolved" else getattr(spec, name)


def check_checkpoint_matches(planned: ModelSpec, found: ModelSpec, *, checkpoint: str) -> None:
    """The checkpoint's config must describe the plan's model: same widths, layers, heads, vocabulary."""
    for name in MATCHED_FIELDS:
        want, got = _field(planned, name), _field(found, name)
        if want != got:
            label = "head_dim" if name == "head_dim_resolved" else name
            raise ShardplanError(f"the checkpoint's {label} is {got}, the plan's model ({planned.name}) has {want}",
                                 source=checkpoint, field=label,
                                 hint="give the checkpoint of the model the plan was made for")


def plan_model_spec(m: DeploymentManifest, found: ModelSpec, plan: str, checkpoint: str) -> ModelSpec:
    """The plan's model spec: its source when it can be read (and still hashes to the plan's),
    else the checkpoint's config when that hashes to the plan's model."""
    from shardplan.plan.readback import matches_plan, optional_checked_spec

    spec = optional_checked_spec(m, plan)
    if spec is not None:
        return spec
    renamed = found.model_copy(update={"name": m.model.name})
    if matches_plan(renamed, m) or matches_plan(found, m):
        return renamed
    raise ShardplanError(f"the plan's model spec ({m.model.source}) cannot be read, and the checkpoint's config is not "
                         "the model the plan recorded", source=checkpoint, field="model.spec_sha256",
                         hint="run verify where the plan's model file exists, or re-plan from this checkpoint")


def predict(m: DeploymentManifest, spec: ModelSpec) -> OffloadPrediction:
    """The plan's byte counts for the compared quantities (module docstring)."""
    from shardplan.cost.memory_serving import rotary_cache_bytes
    from shardplan.cost.offload import offload_memory
    from shardplan.plan.readback import plan_layout, plan_workload
    from shardplan.units import DType

    wl = plan_workload(m)
    off = offload_memory(spec, plan_layout(m), wl)  # type: ignore[arg-type]  # a serving plan (checked)
    stage = m.predicted.memory.stages[0]
    return OffloadPrediction(
        gpu_weights_bytes=stage.per_gpu_bytes["weights"], streamed_buffer_bytes=off.streamed_buffer_bytes,
        rotary_cache_bytes=rotary_cache_bytes(spec, DType(m.workload.activation_dtype)),
        host_bytes=stage.host_offload_bytes, nvme_bytes=stage.nvme_offload_bytes,
        moved_per_token_bytes=off.weights_held_bytes - off.embedding_off_gpu_bytes, layers=off.layers)


def prepare(m: DeploymentManifest, *, plan: str, checkpoint: Path, prompt_len: int, new_tokens: int) -> OffloadRun:
    """Check the plan and the checkpoint, export the plan's device_map with the accelerate
    exporter, and read the predictions. Raises ShardplanError (exit 2) for bad input."""
    import json

    from shardplan.exporters import export
    from shardplan.exporters.base import torch_dtype

    check_offloaded_serving_plan(m, plan)
    found = checkpoint_spec(checkpoint)
    spec = plan_model_spec(m, found, plan, str(checkpoint))
    check_checkpoint_matches(spec, found, checkpoint=str(checkpoint))
    files = {f.name: f.text for f in export(m, "accelerate", spec=spec)}
    doc = json.loads(files["device_map.json"])
    vocab = spec.vocab_size
    prompt = tuple((1 + PROMPT_SEED * i) % vocab for i in range(prompt_len))
    where: Literal["cpu", "nvme"] = "cpu" if m.layout.offload_params == "cpu" else "nvme"
    return OffloadRun(plan=plan, checkpoint=checkpoint, manifest=m, spec=spec, device_map=doc["device_map"],
                      no_split_module_classes=tuple(doc["no_split_module_classes"]),
                      torch_dtype=torch_dtype(m.workload.activation_dtype), offload_params=where, prompt=prompt,
                      new_tokens=new_tokens, prediction=predict(m, spec))


# ----- the comparison --------------------------------------------------------------------------


def within(measured: float, predicted: float, tolerance: float = TOLERANCE) -> tuple[bool, float | None]:
    """(passes, relative error): |measured - predicted| <= tolerance x predicted; a prediction of
    0 passes only a measurement of 0."""
    if predicted == 0:
        return measured == 0, None
    err = (measured - predicted) / predicted
    return abs(err) <= tolerance, err


def _quantity(name: str, device: str, measured: float, predicted: float, measured_how: str,
              predicted_how: str) -> OffloadQuantity:
    ok, err = within(measured, predicted)
    return OffloadQuantity(quantity=name, device=device, measured_bytes=measured, predicted_bytes=predicted,
                           relative_error=err, tolerance=TOLERANCE, ok=ok, measured_how=measured_how,
                           predicted_how=predicted_how)


def quantities(p: OffloadPrediction, got: OffloadMeasurement) -> list[OffloadQuantity]:
    return [
        _quantity("gpu_resident_weights", "gpu", got.gpu_resident_bytes, p.gpu_resident_bytes,
                  "parameters and buffers materialized on the GPU after dispatch",
                  "plan weights per GPU - streamed buffer - rotary cache"),
        _quantity("gpu_peak_weights", "gpu", got.gpu_peak_bytes, p.gpu_peak_bytes,
                  "most parameter and buffer bytes materialized at once while generating",
                  "plan weights per GPU - rotary cache"),
        _quantity("host_offload", "cpu", got.host_bytes, p.host_bytes,
                  "accelerate's weights_map tensors in host memory", "plan host_offload_bytes"),
        _quantity("disk_offload", "disk", got.disk_bytes, p.nvme_bytes,
                  "the .dat files accelerate wrote into the offload folder", "plan nvme_offload_bytes"),
        _quantity("moved_per_token", "host->gpu", got.moved_per_token_bytes, p.moved_per_token_bytes,
                  "bytes AlignDevicesHook copied to the GPU / forwards",
                  "offload_memory weights_held_bytes - embedding share"),
    ]


def compare(run: OffloadRun, got: OffloadMeasurement) -> OffloadVerifyReport:
    """The report: each quantity within TOLERANCE, and the tokens identical to the whole model's."""
    p = run.prediction
    rows = quantities(p, got)
    same = got.tokens == got.reference_tokens
    numerics = OffloadNumerics(check="greedy tokens vs the same checkpoint loaded whole", prompt_tokens=len(run.prompt),
                               new_tokens=run.new_tokens, tokens=list(got.tokens),
                               reference_tokens=list(got.reference_tokens), ok=same)
    mismatches = [f"{q.quantity} ({q.device}): measured {q.measured_bytes:,.0f} B, predicted {q.predicted_bytes:,.0f} B"
                  + (f" ({q.relative_error:+.1%}, tolerance {q.tolerance:.0%})" if q.relative_error is not None else
                     " (predicted none)") for q in rows if not q.ok]
    if not same:
        mismatches.append(f"numerics: the offloaded model generated {list(got.tokens)}, the whole model "
                          f"{list(got.reference_tokens)}")
    notes = [
        f"{GPU_STAND_IN}: accelerate treats it as a device apart from its 'cpu' offload target, so the offloaded "
        "layers go through the same hooks as beside a GPU; time is not measured",
        f"the plan's rotary cos/sin cache ({p.rotary_cache_bytes:,.0f} B) is left out of the GPU predictions: "
        "transformers keeps only inv_freq and computes cos/sin per forward",
        f"the plan streams one {run.manifest.workload.offload_stream_unit} at a time "  # type: ignore[union-attr]
        f"({p.streamed_buffer_bytes:,.0f} B in flight): the resident weights are the plan's less it, the peak "
        "includes it",
    ]
    if got.forwards != run.new_tokens:
        notes.append(f"{got.forwards} forwards for {run.new_tokens} tokens asked (generation stopped early)")
    return OffloadVerifyReport(
        plan=run.plan, checkpoint=str(run.checkpoint), status="ok" if not mismatches else "mismatch",
        model=run.manifest.model.name, dtype=run.torch_dtype, offload_params=run.offload_params,
        offloaded_layers=list(p.layers),
        offloaded_modules=[k for k, v in run.device_map.items() if v in ("cpu", "disk")],
        device_map=dict(run.device_map), device=GPU_STAND_IN, forwards=got.forwards,
        moved_bytes_total=got.moved_bytes_total, quantities=rows, numerics=numerics, notes=notes,
        mismatches=mismatches)


__all__ = ["TOLERANCE", "OffloadQuantity", "OffloadNumerics", "OffloadVerifyReport", "OffloadPrediction",
           "OffloadMeasurement", "OffloadRun", "check_offloaded_serving_plan", "checkpoint_spec",
           "check_checkpoint_matches", "plan_model_spec", "predict", "prepare", "within", "quantities", "compare"]
