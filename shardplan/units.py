"""The only module that knows unit factors and dtype sizes.

Inside shardplan everything is SI: bytes, seconds, FLOP/s, bytes per second. Human units
appear only in YAML keys that name them (`_gib`, `_gb_per_s`, `_tflops`, `_us`) and in
rendered output. Capacity is binary (GiB = 2**30 bytes); bandwidth and FLOP/s are decimal.
"""

from __future__ import annotations

from enum import Enum

BYTES_PER_GIB = 1024**3
BYTES_PER_MIB = 1024**2
BYTES_PER_GB = 10**9
FLOPS_PER_TFLOPS = 10**12
SECONDS_PER_US = 1e-6
SECONDS_PER_MS = 1e-3


class DType(str, Enum):
    """Numeric formats for weights, activations, KV cache and optimizer states."""

    FP32 = "fp32"
    TF32 = "tf32"
    BF16 = "bf16"
    FP16 = "fp16"
    FP8 = "fp8"
    INT8 = "int8"
    INT4 = "int4"
    FP4 = "fp4"
    # ggml's block formats (llama.cpp's --cache-type-k/v): 32 values share one fp16 scale.
    Q8_0 = "q8_0"
    Q4_0 = "q4_0"


# ggml block formats: (values per block, bytes per block), the block structs of
# ggml/src/ggml-common.h (what ggml_blck_size / ggml_type_size return). cost/gguf.py types GGUF
# tensors with them; the KV formats q8_0 and q4_0 take their bytes per value from here.
GGML_BLOCKS: dict[str, tuple[int, int]] = {
    "f32": (1, 4),
    "f16": (1, 2),
    "q4_0": (32, 18),  # fp16 d + 16 bytes of 4-bit quants
    "q4_1": (32, 20),  # fp16 d, m + 16
    "q5_0": (32, 22),  # fp16 d + 4 bytes of high bits + 16
    "q5_1": (32, 24),
    "q8_0": (32, 34),  # fp16 d + 32 int8
    "q2_k": (256, 84),  # 16 scales + 64 quants + fp16 d, dmin
    "q3_k": (256, 110),  # 32 hmask + 64 quants + 12 scales + fp16 d
    "q4_k": (256, 144),  # fp16 d, dmin + 12 scales + 128 quants
    "q5_k": (256, 176),  # + 32 bytes of high bits
    "q6_k": (256, 210),  # 128 ql + 64 qh + 16 scales + fp16 d
    "iq4_nl": (32, 18),
    "iq4_xs": (256, 136),  # fp16 d + 2 scales_h + 4 scales_l + 128 quants
}

BYTES_PER_ELEMENT: dict[DType, float] = {
    DType.FP32: 4.0,
    DType.TF32: 4.0,
    DType.BF16: 2.0,
    DType.FP16: 2.0,
    DType.FP8: 1.0,
    DType.INT8: 1.0,
    DType.INT4: 0.5,
    DType.FP4: 0.5,
    DType.Q8_0: GGML_BLOCKS["q8_0"][1] / GGML_BLOCKS["q8_0"][0],  # 8.5 bits
    DType.Q4_0: GGML_BLOCKS["q4_0"][1] / GGML_BLOCKS["q4_0"][0],  # 4.5 bits
}

# Names that Hugging Face configs and users write for the same formats.
DTYPE_ALIASES: dict[str, DType] = {
    "float32": DType.FP32,
    "fp32": DType.FP32,
    "float": DType.FP32,
    "tf32": DType.TF32,
    "bfloat16": DType.BF16,
    "bf16": DType.BF16,
    "float16": DType.FP16,
    "fp16": DType.FP16,
    "half": DType.FP16,
    "fp8": DType.FP8,
    "float8": DType.FP8,
    "fp8_e4m3": DType.FP8,
    "fp8_e5m2": DType.FP8,
    "int8": DType.INT8,
    "int4": DType.INT4,
    "fp4": DType.FP4,
    "nvfp4": DType.FP4,
    "mxfp4": DType.FP4,
    "q8_0": DType.Q8_0,
    "q4_0": DType.Q4_0,
}


def parse_dtype(text: str) -> DType:
    """Map a dtype name as users and HF configs write it to a DType; raise KeyError if unknown."""
    return DTYPE_ALIASES[text.strip().lower()]


def bytes_per_element(dtype: DType) -> float:
    return BYTES_PER_ELEMENT[dtype]


def gib_to_bytes(value_gib: float) -> int:
    return int(round(value_gib * BYTES_PER_GIB))


def bytes_to_gib(value_bytes: float) -> float:
    return value_bytes / BYTES_PER_GIB


def gb_per_s_to_bytes_per_second(value_gb_per_s: float) -> float:
    return value_gb_per_s * BYTES_PER_GB


def tflops_to_flops(value_tflops: float) -> float:
    return value_tflops * FLOPS_PER_TFLOPS


def us_to_seconds(value_us: float) -> float:
    return value_us * SECONDS_PER_US
