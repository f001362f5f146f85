"""capacity on one consumer GPU: the longest context and the most sequences per weight format,
with and without offload, through the CLI's --json."""

from __future__ import annotations


def test_one_gpu_capacity_with_and_without_offload_per_gguf_format(cli):
    res = cli("capacity", "llama-3.1-70b", "-H", "rtx-4090-24gb", "--engine", "llamacpp", "--context", "8192",
              "--max-gpus", "1", "--json")
    assert res.exit_code in (0, 3), res.stderr
    d = res.json()
    formats = {f["quantization"]: f for f in d["formats"]}
    # llama.cpp's own formats are the rows (its knowledge file's weight_formats), not vLLM's
    assert {"q4_k_m", "q8_0", "q2_k"} <= set(formats) and "int4" not in formats
    for q in ("q4_k_m", "q8_0"):
        (row,) = [p for p in formats[q]["per_tp"] if p["tp"] == 1]
        assert not row["serves"]  # 42 GB (q4_k_m) or 75 GB (q8_0) of weights: not on 24 GB alone
        # every layer on the CPU: the model's whole context, a real decode time, slower than a GPU step
        assert row["longest_context_tokens_offloaded"] == 131072
        assert row["most_sequences_offloaded"] >= 1
        assert row["tpot_seconds_offloaded"] > 0.1
    q4, q8 = ([p for p in formats[q]["per_tp"] if p["tp"] == 1][0] for q in ("q4_k_m", "q8_0"))
    assert q8["tpot_seconds_offloaded"] > 1.5 * q4["tpot_seconds_offloaded"]  # more bytes read from DRAM


def test_capacity_of_an_engine_without_offload_has_no_offloaded_figures(cli):
    d = cli("capacity", "llama-3.1-8b", "-H", "rtx-4090-24gb", "--engine", "sglang", "--max-gpus", "1", "--json").json()
    for f in d["formats"]:
        for p in f["per_tp"]:
            assert "longest_context_tokens_offloaded" not in p
