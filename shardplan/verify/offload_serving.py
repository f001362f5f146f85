"""`verify PLAN --checkpoint DIR` for an offloaded serving plan, run for real on the CPU with
accelerate: the plan's device_map (from the accelerate exporter), loaded with
`load_checkpoint_in_model` and `dispatch_model`, "disk" entries into an offload folder; a short
greedy generation, its tokens compared with the same checkpoint loaded whole; the bytes each
device holds, the GPU's peak while generating and the bytes moved per generated token, compared
with the plan by `verify.offload_compare` (which says what is compared).

GPU 0 does not exist here: its device-map entries are loaded on `torch.device("cpu")`, which
accelerate treats as a device of its own, distinct from the "cpu" offload target (dispatch_model:
the main device is the first value that is not "cpu"/"disk"). So "cpu" entries really go
through accelerate's offload hooks into its weights_map, and "disk" entries into the offload
folder, as beside a GPU (the approach of tests/exporters/test_export_offload.py).

torch, accelerate and transformers are imported inside the functions that use them: the CLI
imports this module only for `verify --checkpoint`.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from shardplan.errors import ShardplanError, VerifyRunFailed
from shardplan.verify.offload_compare import OffloadMeasurement, OffloadRun, OffloadVerifyReport, compare, prepare

RUN_NEEDS = ("torch", "accelerate", "transformers")  # what the run imports, checked before it starts
OFFLOAD_FOLDER_PREFIX = "shardplan-offload-"  # a fresh folder per run, removed after: stale .dat files never count


def verify_offloaded_plan(plan: Path, checkpoint: Path, *, offload_folder: Path | None = None) -> OffloadVerifyReport:
    """Load the plan's checkpoint offloaded as the plan says, generate, measure and compare.
    Raises ShardplanError (exit 2) for bad input, VerifyRunFailed (exit 5) when the run fails.
    `offload_folder`: where a disk-offloading plan's layers are written (a fresh folder inside
    it, removed after); None: the system's temporary folder."""
    from shardplan.plan.manifest import load_manifest
    from shardplan.verify.runspec import SERVING_MAX_DECODE, SERVING_MAX_PROMPT

    m = load_manifest(plan)
    wl = m.workload
    run = prepare(m, plan=str(plan), checkpoint=checkpoint,
                  prompt_len=min(getattr(wl, "input_len", 1), SERVING_MAX_PROMPT),
                  new_tokens=min(getattr(wl, "output_len", 1), SERVING_MAX_DECODE))
    missing = [name for name in RUN_NEEDS if importlib.util.find_spec(name) is None]
    if missing:
        raise ShardplanError(f"verify --checkpoint loads the plan with {', '.join(RUN_NEEDS)}; {', '.join(missing)} "
                             "is not installed", field="--checkpoint", hint=f"pip install {' '.join(missing)}")
    if offload_folder is not None and run.offload_params != "nvme":
        raise ShardplanError("applies to a plan that offloads to disk (offload_params nvme); this one offloads to cpu",
                             field="--offload-folder", hint="drop --offload-folder")
    with _offload_folder(offload_folder if run.offload_params == "nvme" else None,
                         needed=run.offload_params == "nvme") as folder:
        try:
            measured = measure(run, folder)
        except Exception as e:  # noqa: BLE001 - any failure of the run is a failed run (exit 5), named
            raise VerifyRunFailed(f"the offloaded run failed: {type(e).__name__}: {e}", source=str(checkpoint),
                                  hint="check that the checkpoint loads with transformers (SHARDPLAN_DEBUG=1 shows "
                                       "the traceback)") from e
    return compare(run, measured)


@contextlib.contextmanager
def _offload_folder(parent: Path | None, *, needed: bool) -> Iterator[Path | None]:
    """A fresh, empty folder for accelerate's .dat files inside `parent` (None: the system's
    temporary folder), removed after; one line (exit 2) when it cannot be written."""
    if not needed:
        yield None
        return
    try:
        if parent is not None:
            parent.mkdir(parents=True, exist_ok=True)
        folder = Path(tempfile.mkdtemp(prefix=OFFLOAD_FOLDER_PREFIX, dir=parent))
    except OSError as e:
        where = str(parent) if parent is not None else tempfile.gettempdir()
        raise ShardplanError(f"offload folder {where} cannot be written ({e.strerror or e})", field="--offload-folder",
                             hint="give a writable folder (a local NVMe) with --offload-folder DIR") from e
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# ----- the run (torch) ---------------------------------------------------------------------------


def measure(run: OffloadRun, folder: Path | None) -> OffloadMeasurement:
    """The reference generation on the whole model, then the offloaded one, measured."""
    import torch

    with _quiet():
        reference = _reference_tokens(run)
        model = _load_offloaded(run, folder)
        resident = materialized_bytes(model)
        held = held_off_gpu_bytes(model, folder)
        with torch.no_grad(), _counting_moves(model, resident) as moves:
            tokens = _generate(model, run)
        return OffloadMeasurement(gpu_resident_bytes=resident, gpu_peak_bytes=moves.peak_bytes,
                                  host_bytes=held["cpu"], disk_bytes=held["disk"], moved_bytes_total=moves.moved_bytes,
                                  forwards=moves.forwards, tokens=tokens, reference_tokens=reference)


def _empty_model(run: OffloadRun) -> Any:
    """The checkpoint's architecture on the meta device, in the plan's format."""
    import accelerate
    import transformers

    config = transformers.AutoConfig.from_pretrained(run.checkpoint)
    with accelerate.init_empty_weights():
        return transformers.AutoModelForCausalLM.from_config(config, dtype=run.torch_dtype)


def _reference_tokens(run: OffloadRun) -> tuple[int, ...]:
    """Greedy tokens of the checkpoint loaded whole, built and loaded as the offloaded one is, so
    that only the offload differs."""
    import accelerate
    import torch

    whole = _empty_model(run)
    accelerate.load_checkpoint_in_model(whole, str(run.checkpoint), device_map={"": "cpu"}, dtype=run.torch_dtype)
    with torch.no_grad():
        tokens = _generate(whole.eval(), run)
    del whole
    gc.collect()
    return tokens


def _load_offloaded(run: OffloadRun, folder: Path | None) -> Any:
    """load_checkpoint_and_dispatch in its two steps: safetensors opens tensors on a device named by
    a string, so GPU 0's modules load on "cpu"; dispatch then runs with the stand-in device."""
    import accelerate
    import torch

    dmap = run.device_map
    disk = "disk" in dmap.values()
    model = _empty_model(run)
    accelerate.load_checkpoint_in_model(
        model, str(run.checkpoint), device_map={k: "cpu" if isinstance(v, int) else v for k, v in dmap.items()},
        offload_folder=str(folder) if disk else None, offload_state_dict=disk, dtype=run.torch_dtype)
    stand_in = {k: torch.device("cpu") if isinstance(v, int) else v for k, v in dmap.items()}
    return accelerate.dispatch_model(model, device_map=stand_in, offload_dir=str(folder) if disk else None).eval()


def _generate(model: Any, run: OffloadRun) -> tuple[int, ...]:
    """Greedy generation of exactly `new_tokens` tokens (min_new_tokens: an early end-of-sequence
    would change the number of forwards)."""
    import torch

    ids = torch.tensor([list(run.prompt)], dtype=torch.long)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=run.new_tokens,
                         min_new_tokens=run.new_tokens, do_sample=False,
                         pad_token_id=model.config.eos_token_id if model.config.eos_token_id is not None else 0)
    return tuple(int(t) for t in out[0].tolist())


def tensor_bytes(tensors: Iterable[Any]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def materialized_bytes(model: Any) -> int:
    """Bytes of the parameters and buffers that are not on the meta device: what the GPU (its
    stand-in) holds; offloaded modules' tensors are meta between their forwards."""
    return tensor_bytes(t for t in (*model.parameters(), *model.buffers()) if t.device.type != "meta")


def held_off_gpu_bytes(model: Any, folder: Path | None) -> dict[str, int]:
    """Bytes accelerate keeps off the GPU: its weights_map tensors in host memory ("cpu") and the
    .dat files it wrote into the offload folder ("disk")."""
    loaders = {id(h.weights_map.dataset): h.weights_map.dataset for mod in model.modules()
               if (h := getattr(mod, "_hf_hook", None)) is not None and getattr(h, "offload", False)
               and getattr(h, "weights_map", None) is not None and hasattr(h.weights_map, "dataset")}
    cpu = sum(tensor_bytes(ds.state_dict.values()) for ds in loaders.values())
    disk = sum(f.stat().st_size for f in folder.rglob("*.dat")) if folder is not None and folder.is_dir() else 0
    return {"cpu": cpu, "disk": disk}


class _Moves:
    """What the offload hooks did during one generation."""

    def __init__(self, resident_bytes: int) -> None:
        self.moved_bytes = 0  # bytes copied to the execution device
        self.peak_bytes = resident_bytes  # most bytes materialized at once
        self.forwards = 0  # forwards of the whole model


@contextlib.contextmanager
def _counting_moves(model: Any, resident_bytes: int) -> Iterator[_Moves]:
    """Count what AlignDevicesHook.pre_forward brings to the execution device: it calls
    `set_module_tensor_to_device(module, name, execution_device, value=weights_map[name])` for
    every tensor of an offloaded module (accelerate/hooks.py), and sets it back to "meta" in
    post_forward. The name is patched where hooks.py looks it up, for this generation only;
    after each copy the materialized bytes are summed, for the peak."""
    import accelerate.hooks as hooks

    moves = _Moves(resident_bytes)
    original = hooks.set_module_tensor_to_device

    def counting(module: Any, tensor_name: str, device: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(module, tensor_name, device, *args, **kwargs)
        value = kwargs.get("value", args[0] if args else None)
        if value is not None and str(device) != "meta":
            moves.moved_bytes += value.numel() * value.element_size()
            moves.peak_bytes = max(moves.peak_bytes, materialized_bytes(model))
        return result

    def count_forward(*_: Any) -> None:
        moves.forwards += 1

    handle = model.register_forward_pre_hook(count_forward)
    hooks.set_module_tensor_to_device = counting
    try:
        yield moves
    finally:
        hooks.set_module_tensor_to_device = original
        handle.remove()


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """transformers' warnings and progress bars off while verify runs, and what accelerate writes
    to stderr as it loads (a progress bar per tensor, a warning that offloaded parameters are on
    the meta device, which is the point) kept out of the terminal: failures are raised, not printed."""
    import io

    import transformers

    level = transformers.logging.get_verbosity()
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        transformers.logging.set_verbosity(level)
        if bars:
            transformers.utils.logging.enable_progress_bar()


__all__ = ["verify_offloaded_plan", "measure", "materialized_bytes", "held_off_gpu_bytes", "tensor_bytes"]
