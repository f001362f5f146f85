"""llama.cpp: a `llama-server` command line per replica, and a README.txt that says what each flag
does and where the GGUF file comes from. Every flag is checked against `flags/llamacpp-<tag>.yaml`,
the options of the pinned release's own `llama-server --help` (tools/dump_llamacpp_flags.py; the
file names the tag, commit and method). Mapping, with the rules of that release's source:
- weights: a GGUF file of the plan's format (layout.weight_quantization: q4_k_m -> *-Q4_K_M.gguf;
  none -> the 16-bit activation dtype, *-BF16.gguf / *-F16.gguf). fp8, int8, int4, awq, gptq and
  nf4 are not GGUF types: refused.
- --n-gpu-layers: llama.cpp counts the output layer as one of its n_layer + 1 "layers" and keeps
  the LAST n_gpu_layers on the GPU (src/llama-model.cpp load_tensors: i_gpu_start =
  max(n_layer + 1 - n_gpu_layers, 0)); the plan's offload_layers are the first decoder layers,
  so n_gpu_layers = num_layers + 1 - offload_layers, and `all` when nothing is offloaded.
- --n-cpu-moe N: the plan's offload_expert_layers, the routed experts (ffn_(up|down|gate|gate_up)_exps)
  of decoder layers 0..N-1 in host memory, run by the CPU (common/arg.cpp: one
  `blk\\.<i>\\.ffn_..._exps` -> CPU buffer override per layer, common/common.h
  llm_add_n_cpu_ffn_overrides); given beside --n-gpu-layers, which places everything else.
- --parallel N slots, --ctx-size = max_model_len x N with --no-kv-unified: the KV cache is one
  stream per slot of ctx_size / N cells (src/llama-context.cpp: n_ctx_seq = n_ctx / n_seq_max,
  both padded to 256), so each slot holds one max_model_len sequence, vLLM's meaning. The server
  turns a unified cache on only when -np is left to auto (tools/server/server.cpp); the flag says
  it anyway. N is the plan's max_num_seqs, fewer when the plan's KV cache holds fewer whole
  sequences: llama.cpp allocates all N x max_model_len cells at start.
- several GPUs of one replica: pipeline stages -> --split-mode layer with --tensor-split in
  proportion to each stage's decoder layers (the last stage's share counts the output layer, so
  each stage gets exactly its layers); tensor parallelism -> --split-mode row, equal shares: each
  weight matrix's rows are split over the GPUs and every GPU works on every layer. llama.cpp
  takes one split mode for all its GPUs: tp x pp together is refused.
- replicas (dp) -> one server each on its own GPUs (CUDA_VISIBLE_DEVICES) and port; a replica
  over several nodes (llama.cpp's RPC backend) and expert parallelism (none in llama.cpp: experts
  follow their layer's GPU or its row split) are refused, as are speculative decoding and NVMe
  offload (no export of a draft model; offloaded layers live in host memory, the page cache of
  the mmapped GGUF).
"""

from __future__ import annotations

from shardplan.errors import ShardplanError
from shardplan.exporters.base import (
    Arg,
    ExportContext,
    ExportFile,
    PlanDoesNotFit,
    checked_word,
    command,
    comment,
    flag_table,
    plan_header,
    safe_name,
    script,
    serving,
)
from shardplan.exporters.serving import DEFAULT_PORT, each_node_note, node_replicas, replicas_script
from shardplan.exporters.targets import check

TARGET = "llamacpp"
PINNED_TAG = "b11312"  # flags/llamacpp-b11312.yaml: commit 0c1e57098bba43ac29e6e3b677cdceebdd22334f
HEALTH_PATH = "/health"  # GET, 200 once the model is loaded (tools/server/README.md)
CTX_PAD_TOKENS = 256  # src/llama-context.cpp: n_ctx and each slot's n_ctx_seq are padded to 256 cells
MAX_SLOTS = 256  # src/llama-cparams.h LLAMA_MAX_SEQ; llama-context.cpp refuses n_seq_max above it
DEFAULT_N_BATCH = 2048  # common/common.h n_batch: the logical batch; the physical --ubatch-size may not exceed it
GGUF_TYPES = {"q2_k": "Q2_K", "q3_k_m": "Q3_K_M", "q4_0": "Q4_0", "q4_k_m": "Q4_K_M", "q5_k_m": "Q5_K_M",
              "q6_k": "Q6_K", "q8_0": "Q8_0", "iq4_xs": "IQ4_XS"}  # llama-quantize's type names
_UNQUANTIZED = {"bf16": "BF16", "fp16": "F16", "fp32": "F32"}  # convert_hf_to_gguf.py --outtype, upper case
# ggml type names --cache-type-k/v take (flags/llamacpp-b11312.yaml choices); q8_0/q4_0 are ggml's
# block formats (34 and 18 bytes per 32 values), which need --flash-attn on for the V cache.
_CACHE_TYPES = {"fp16": "f16", "bf16": "bf16", "fp32": "f32", "q8_0": "q8_0", "q4_0": "q4_0"}


def table():
    return flag_table(f"llamacpp-{PINNED_TAG}")


def expressible(ctx: ExportContext) -> None:
    """Refuse what one llama-server per replica cannot run (knowledge/targets.yaml): expert or
    context parallelism, tp with pp, a replica over nodes, offload with stages or off host
    memory, speculative decoding, weights or a KV cache that are not GGUF types."""
    serving(ctx, TARGET)
    check(ctx, TARGET)


def weight_type(ctx: ExportContext) -> str:
    """The GGUF file's type, as llama-quantize names it (Q4_K_M) or, unquantized, BF16/F16/F32."""
    expressible(ctx)
    m = ctx.manifest
    q = m.layout.weight_quantization or "none"
    return GGUF_TYPES[q] if q in GGUF_TYPES else _UNQUANTIZED[m.workload.activation_dtype]


def cache_type(ctx: ExportContext) -> str:
    """--cache-type-k/v: the plan's KV format where llama.cpp has exactly it (q8_0 is ggml's 8.5-bit block
    format, not int8; a quantized V cache needs the --flash-attn on that server_args always gives)."""
    expressible(ctx)
    return _CACHE_TYPES[ctx.manifest.layout.kv_cache_dtype or ctx.manifest.workload.activation_dtype]


def gguf_path(ctx: ExportContext) -> str:
    """--model-path when given (a .gguf file), else a placeholder named after the model and format."""
    if ctx.options.model_path is not None:
        path = checked_word(ctx.options.model_path, "--model-path", "the path of a .gguf file")
        if not path.endswith(".gguf"):
            raise ShardplanError(f"{path!r} is not a GGUF file", field="--model-path",
                                 hint="give the .gguf file llama-server loads (see README.txt for how to make one)")
        return path
    m = ctx.manifest
    base = (m.model.hf_id or m.model.name).rsplit("/", 1)[-1]
    return f"/models/{safe_name(base, 'model')}-{weight_type(ctx)}.gguf"


def gpu_layers(ctx: ExportContext) -> str | int:
    """--n-gpu-layers: the output layer and the last num_layers - offload_layers decoder layers."""
    m = ctx.manifest
    k = m.layout.offload_layers
    return "all" if k == 0 else m.model.num_layers + 1 - k


def cpu_moe_args(ctx: ExportContext) -> list[Arg]:
    """--n-cpu-moe N when the plan keeps the first N layers' routed experts in host memory."""
    n = ctx.manifest.layout.offload_expert_layers
    return [("n-cpu-moe", n)] if n else []


def slots(ctx: ExportContext) -> int:
    """--parallel: max_num_seqs, or the whole max_model_len sequences the plan's KV cache holds if
    fewer, and at most MAX_SLOTS."""
    m = ctx.manifest
    wl = serving(ctx, TARGET)
    kv = m.predicted.kv_cache
    assert kv is not None
    held = kv.capacity_tokens // kv.max_model_len_tokens
    if held < 1:
        raise PlanDoesNotFit(f"llama-server allocates the KV cache of every slot at start, and the plan's holds "
                             f"{kv.capacity_tokens} tokens, short of one {kv.max_model_len_tokens}-token sequence",
                             field="workload.max_model_len",
                             hint="re-plan with --engine llamacpp, a shorter --max-model-len or more GPUs")
    return min(wl.max_num_seqs, held, MAX_SLOTS)


def split_args(ctx: ExportContext) -> list[Arg]:
    """How one replica's GPUs share the model: whole layers by stage, or rows of every matrix."""
    m = ctx.manifest
    L = m.layout
    if L.pp > 1:
        shares = [sum(b - a + 1 for a, b in s.layer_ranges) + (1 if s.lm_head else 0) for s in m.placement.stages]
        return [("split-mode", "layer"), ("tensor-split", ",".join(map(str, shares)))]
    if L.tp > 1:
        return [("split-mode", "row"), ("tensor-split", ",".join(["1"] * L.tp))]
    return []


def server_args(ctx: ExportContext, *, port: int) -> list[Arg]:
    m = ctx.manifest
    wl = serving(ctx, TARGET)
    expressible(ctx)
    kv = m.predicted.kv_cache
    assert kv is not None
    n = slots(ctx)
    ubatch = wl.max_num_batched_tokens
    args: list[Arg] = [("model", gguf_path(ctx)), ("n-gpu-layers", gpu_layers(ctx)), *cpu_moe_args(ctx),
                       *split_args(ctx),
                       ("ctx-size", kv.max_model_len_tokens * n), ("parallel", n), ("no-kv-unified", None),
                       ("cache-type-k", cache_type(ctx)), ("cache-type-v", cache_type(ctx)), ("flash-attn", "on"),
                       ("ubatch-size", ubatch)]
    if ubatch > DEFAULT_N_BATCH:
        args.append(("batch-size", ubatch))
    return [*args, ("host", "0.0.0.0"), ("port", port)]


def server_command(ctx: ExportContext, *, port: int) -> str:
    return command(table(), ["llama-server"], server_args(ctx, port=port))


def header(ctx: ExportContext) -> list[str]:
    """plan_header, without its advice to re-plan with --engine-version <pinned tag>: shardplan's
    llama.cpp rules are named by the build they were read at, not by the pinned tag."""
    m, t = ctx.manifest, table()
    lines = plan_header(m, TARGET, t)
    return [f"note: planned with {m.workload.engine} {m.workload.engine_version}'s memory rules; the flags are "
            f"{t.version}'s" if line.startswith(f"note: planned for {TARGET} ") else line for line in lines]


def notes(ctx: ExportContext) -> list[str]:
    """What the script header says beside the plan header."""
    m = ctx.manifest
    wl = serving(ctx, TARGET)
    kv = m.predicted.kv_cache
    assert kv is not None
    n, L = slots(ctx), m.layout
    slot_ctx = -(-kv.max_model_len_tokens // CTX_PAD_TOKENS) * CTX_PAD_TOKENS
    out = [f"KV cache: {n} slot(s) x {slot_ctx} cells (max_model_len {kv.max_model_len_tokens}, padded to "
           f"{CTX_PAD_TOKENS}), allocated at start"]
    if ctx.options.model_path is None:
        out.insert(0, f"model: {gguf_path(ctx)} is a placeholder: put the {weight_type(ctx)} GGUF file of "
                      f"{m.model.name} there, or export again with --model-path (README.txt says how to make one)")
    if n < wl.max_num_seqs:
        why = (f"llama.cpp runs at most {MAX_SLOTS} sequences" if n == MAX_SLOTS else
               f"the plan's KV cache holds {kv.capacity_tokens:,} tokens, {n} whole max_model_len sequence(s), and "
               "llama.cpp allocates every slot up front")
        out.append(f"--parallel {n}, not max_num_seqs {wl.max_num_seqs}: {why}")
    if L.pp > 1:
        out.append(f"--split-mode layer: each of the replica's {L.pp} GPUs holds whole layers and their KV cache, one "
                   "after another (a pipeline); --tensor-split gives each GPU its stage's layers (the last stage's "
                   "share counts the output layer)")
    elif L.tp > 1:
        out.append(f"--split-mode row: every weight matrix is split by rows over the replica's {L.tp} GPUs (equal "
                   "--tensor-split shares) and each GPU works on every layer; a layer's KV cache sits on one of them")
    if L.offload_layers:
        out.append(f"offload: the first {L.offload_layers} of {m.model.num_layers} decoder layers (and the token "
                   "embedding) stay in host memory and run on the CPU; set --threads to the node's physical cores if "
                   "llama.cpp's default (common_cpu_get_num_math) counts them wrong")
    if L.offload_expert_layers:
        out.append(f"--n-cpu-moe {L.offload_expert_layers}: the routed experts of the first "
                   f"{L.offload_expert_layers} decoder layers stay in host memory and run on the CPU (a prompt "
                   "ubatch of 32 tokens or more copies the experts it uses to the GPU instead); attention, shared "
                   "experts and the KV cache stay on the GPU")
    if wl.engine != TARGET:
        out.append(f"warning: planned with {wl.engine}'s memory rules; llama.cpp allocates its KV cache and compute "
                   "buffers differently: re-plan with --engine llamacpp")
    if wl.enforce_eager:
        out.append("the plan runs without CUDA graphs: export GGML_CUDA_DISABLE_GRAPHS=1 before starting the server")
    return out


def readme(ctx: ExportContext) -> str:
    """README.txt: the plan, each flag's meaning, how to get the GGUF file."""
    m = ctx.manifest
    t = table()
    L = m.layout
    fmt = weight_type(ctx)
    source = fmt if fmt in _UNQUANTIZED.values() else "BF16"  # what convert_hf_to_gguf.py writes, then quantized
    base = (m.model.hf_id or m.model.name).rsplit("/", 1)[-1]
    lines = [*header(ctx), *notes(ctx), "",
             "What the flags of serve.sh mean (llama.cpp at " + t.version + "; `llama-server --help` says more):",
             f"  --model FILE          the GGUF file: weights ({fmt}), tokenizer and chat template in one file",
             f"  --n-gpu-layers {gpu_layers(ctx)!s:<6} layers held and run on the GPU(s): llama.cpp counts the output "
             "layer as one and keeps the LAST n on the GPU, the rest (and the token embedding) on the CPU",
             "  --ctx-size N          KV cache cells in all, split evenly over the slots (each padded to 256)",
             "  --parallel N          slots: requests decoded together; each holds one sequence of ctx-size / N tokens",
             "  --no-kv-unified       one KV stream per slot (a unified cache lets one slot take the whole context)",
             f"  --cache-type-k/-v {cache_type(ctx):<4} the KV cache's element type",
             "  --flash-attn on       the fused attention kernel (no ctx x ubatch score buffer)",
             "  --ubatch-size N       tokens in one forward pass at most (the plan's max_num_batched_tokens): it sizes "
             "the compute buffer",
             f"  --batch-size N        the logical batch, given when the ubatch exceeds its default {DEFAULT_N_BATCH}",
             "  --host, --port        where the OpenAI-compatible HTTP API listens (GET /health is 200 once loaded)"]
    if L.offload_expert_layers:
        lines.append(f"  --n-cpu-moe {L.offload_expert_layers:<6}    the routed experts (ffn_*_exps tensors) of the first "
                     "N layers stay in host memory, multiplied by the CPU")
    if L.pp > 1 or L.tp > 1:
        lines.append("  --split-mode, --tensor-split  how the replica's GPUs share the model (see above)")
    lines += ["",
              f"Getting the {fmt} GGUF file:",
              f"  - a published one: GGUF repositories on the Hugging Face Hub name files like {base}-{fmt}.gguf",
              "    (llama-server can also fetch one itself: --hf-repo <user>/<repo>:" + fmt + ")",
              "  - or make it from the Hugging Face checkpoint with the tools of the same llama.cpp release:",
              f"      python convert_hf_to_gguf.py <checkpoint folder> --outtype {source.lower()} --outfile "
              f"{base}-{source}.gguf"]
    if fmt in GGUF_TYPES.values():
        lines.append(f"      llama-quantize {base}-{source}.gguf {base}-{fmt}.gguf {fmt}")
        lines.append("    (an importance matrix, llama-imatrix then llama-quantize --imatrix, helps the low-bit types)")
    return "\n".join(comment(line) for line in lines) + "\n"  # names come from the plan file: one line each


def export_llamacpp(ctx: ExportContext) -> list[ExportFile]:
    serving(ctx, TARGET)
    expressible(ctx)
    lines = [*header(ctx), *notes(ctx), *each_node_note(ctx)]
    if len(node_replicas(ctx, TARGET)) > 1:
        body = replicas_script(ctx, lambda r: server_command(ctx, port=r.port))
    else:
        body = [server_command(ctx, port=ctx.options.port or DEFAULT_PORT)]
    return [ExportFile("serve.sh", script(body, header=lines), executable=True),
            ExportFile("README.txt", readme(ctx))]


__all__ = ["export_llamacpp", "server_command", "gpu_layers", "slots", "PINNED_TAG"]
