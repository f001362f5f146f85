"""capacity through the real CLI, checked against the estimate (and recommend) commands' own
`--json` for the same layouts: the fewest GPUs per weight format really fits and nothing
smaller does, the longest context and most sequences per tp are the edges where estimate's
verdict flips, the quantization line, training per ZeRO stage and offload, and bad input."""

from __future__ import annotations

import math

import pytest

MODEL, HW = "llama-3.1-70b", "h100-sxm-80gb"
HEADS, GPUS_PER_NODE = 64, 8


def _json(res, code=0):
    assert res.exit_code == code, (res.exit_code, res.stderr)
    return res.json()


@pytest.fixture(scope="module")
def serving_70b():
    """capacity's JSON for the 70B at 8,192 tokens x 1 sequence, run once for the module."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "shardplan", "capacity", MODEL, "--hardware", HW, "--json"],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def _rows(d):
    return {r["weight_dtype"]: r for r in d["formats"]}


def _estimate(cli, dtype, gpus, tp, pp, context, *extra):
    args = ["estimate", MODEL, "--hardware", HW, "--gpus", str(gpus), "--tp", str(tp), "--pp", str(pp),
            "--max-model-len", str(context), "--json", *extra]
    if dtype != "bf16":
        args += ["--weight-dtype", dtype]
    res = cli(*args)
    assert res.exit_code in (0, 3), (res.exit_code, res.stderr)
    return res.exit_code, res.json()


def test_70b_bf16_needs_two_gpus_int4_fits_on_one_and_the_line_says_so(serving_70b):
    d = serving_70b
    assert (d["model"], d["hardware"], d["workload"]) == (MODEL, HW, "inference")
    assert (d["max_model_len"], d["concurrency"], d["max_gpus"]) == (8192, 1, 64 * GPUS_PER_NODE)
    rows = _rows(d)
    assert list(rows) == ["bf16", "fp8", "int8", "int4"]
    # 70.6B parameters x 2 bytes = 141 GB cannot sit in one 80 GB GPU; int4's ~37 GiB can.
    # (tp=2 and pp=2 hold the same KV on their binding rank; either is the answer)
    assert rows["bf16"]["min_num_gpus"] == 2 and rows["bf16"]["plan"]["tp"] * rows["bf16"]["plan"]["pp"] == 2
    assert rows["int4"]["min_num_gpus"] == 1 and rows["int4"]["plan"] == {"tp": 1, "pp": 1, "dp": 1, "ep": 1}
    # fp8 weights (+ 16-bit embeddings and lm_head) leave enough KV cache for 8,192 tokens on one GPU at
    # vLLM's default 0.92 of the device (from 0.20.0; at 0.9 they did not).
    assert rows["fp8"]["min_num_gpus"] == 1
    q = d["quantization_removes_sharding"]
    assert q == {"weight_dtype": "fp8", "weight_dtypes": ["fp8", "int8", "int4"], "dense_weight_dtype": "bf16",
                 "dense_min_num_gpus": 2}
    for r in rows.values():
        assert r["num_nodes"] == math.ceil(r["min_num_gpus"] / GPUS_PER_NODE)
        assert r["plan"]["tp"] * r["plan"]["pp"] == r["min_num_gpus"]
        assert r["fits"] and r["kv_cache"]["max_concurrency"] >= 1
    # Narrower weights leave more KV cache per GPU on the same layout.
    assert rows["int4"]["per_gpu_bytes"]["kv_cache"] > rows["int8"]["per_gpu_bytes"]["kv_cache"]


def test_each_minimum_is_what_estimate_says_fits_and_nothing_smaller_does(cli, serving_70b):
    d = serving_70b
    for dtype, r in _rows(d).items():
        n, p = r["min_num_gpus"], r["plan"]
        code, est = _estimate(cli, dtype, n, p["tp"], p["pp"], 8192)
        assert code == 0 and est["fits"]
        # the numbers behind the answer are the estimate's own
        assert est["memory"]["per_gpu_bytes"] == r["per_gpu_bytes"]
        assert est["memory"]["headroom_bytes"] == r["headroom_bytes"]
        assert est["kv_cache"] == r["kv_cache"]
        # every single-replica layout at every smaller GPU count the search tries does not serve
        smaller = [c for c in d["gpu_counts_considered"] if c < n]
        for c in smaller:
            for tp in (t for t in (1, 2, 4, 8) if c % t == 0 and HEADS % t == 0):
                code, est = _estimate(cli, dtype, c, tp, c // tp, 8192)
                assert code == 3 or est["kv_cache"]["max_concurrency"] < 1, (dtype, c, tp)
    # The headline case, spelled out: bf16 on one GPU does not fit (exit 3), int4 does (exit 0).
    assert _estimate(cli, "bf16", 1, 1, 1, 8192)[0] == 3
    assert _estimate(cli, "int4", 1, 1, 1, 8192)[0] == 0


def test_longest_context_and_most_sequences_per_tp_are_where_estimate_flips(cli, serving_70b):
    bf16 = {p["tp"]: p for p in _rows(serving_70b)["bf16"]["per_tp"]}
    assert list(bf16) == [1, 2, 4, 8]
    assert bf16[1]["longest_context_tokens"] == 0 and bf16[1]["most_sequences"] == 0 and not bf16[1]["serves"]
    assert "no room for a KV cache" in bf16[1]["reason"]
    two = bf16[2]
    assert 8192 < two["longest_context_tokens"] < 131072
    code, at = _estimate(cli, "bf16", 2, 2, 1, two["longest_context_tokens"])
    assert code == 0 and at["kv_cache"]["max_concurrency"] >= 1
    code, past = _estimate(cli, "bf16", 2, 2, 1, two["longest_context_tokens"] + 1)
    assert code == 3
    code, est = _estimate(cli, "bf16", 2, 2, 1, 8192)
    assert two["most_sequences"] == math.floor(est["kv_cache"]["max_concurrency"]) >= 1
    # More GPUs hold more: capped at the model's 131,072-token context from tp=4.
    assert [bf16[t]["longest_context_tokens"] for t in (4, 8)] == [131072, 131072]
    assert bf16[2]["most_sequences"] < bf16[4]["most_sequences"] < bf16[8]["most_sequences"]
    # int4 on one GPU: the longest context there is between 8K and the model's limit
    int4 = {p["tp"]: p for p in _rows(serving_70b)["int4"]["per_tp"]}
    code, at = _estimate(cli, "int4", 1, 1, 1, int4[1]["longest_context_tokens"])
    assert code == 0
    assert _estimate(cli, "int4", 1, 1, 1, int4[1]["longest_context_tokens"] + 1)[0] == 3


def test_concurrency_raises_the_minimum_and_the_edges_follow_it(cli):
    d = _json(cli("capacity", MODEL, "--hardware", HW, "--context", "32768", "--concurrency", "16", "--json"))
    rows = _rows(d)
    bf16 = rows["bf16"]
    # 16 x 32,768 tokens x 320 KiB = 160 GiB of KV cache on top of 131 GiB of weights
    assert bf16["min_num_gpus"] == 8 and bf16["plan"]["tp"] * bf16["plan"]["pp"] == 8
    p = bf16["plan"]
    code, est = _estimate(cli, "bf16", 8, p["tp"], p["pp"], 32768)
    assert code == 0 and est["kv_cache"] == bf16["kv_cache"] and est["kv_cache"]["max_concurrency"] >= 16
    for tp, pp in ((4, 1), (2, 2), (1, 4)):  # every replica of 4 GPUs: it starts, but holds too few
        code, four = _estimate(cli, "bf16", 4, tp, pp, 32768)
        assert code == 0 and four["kv_cache"]["max_concurrency"] < 16, (tp, pp)
    assert d["quantization_removes_sharding"] is None  # nothing fits 16 long sequences on one GPU
    per_tp = {p["tp"]: p for p in bf16["per_tp"]}
    longest = per_tp[8]["longest_context_tokens"]
    code, at = _estimate(cli, "bf16", 8, 8, 1, longest)
    assert code == 0 and at["kv_cache"]["max_concurrency"] >= 16
    code, past = _estimate(cli, "bf16", 8, 8, 1, longest + 1)
    assert past["kv_cache"]["max_concurrency"] < 16


def test_a_model_that_fits_in_bf16_gets_no_quantization_line(cli):
    d = _json(cli("capacity", "llama-3.1-8b", "--hardware", HW, "--json"))
    assert [r["min_num_gpus"] for r in d["formats"]] == [1, 1, 1, 1]
    assert d["quantization_removes_sharding"] is None


def _training_flags(row):
    p = row["plan"]
    flags = ["--gpus", str(row["min_num_gpus"]), "--tp", str(p["tp"]), "--pp", str(p["pp"]), "--cp", str(p["cp"]),
             "--zero-stage", str(p["zero_stage"]), "--recompute", p["recompute"], "--pp-schedule", p["pp_schedule"],
             "--virtual-stages", str(p["virtual_stages"]), "--micro-batch-size", str(p["micro_batch_size"]),
             "--offload", row["offload"]]
    if p["sequence_parallel"]:
        flags.append("--sequence-parallel")
    if p["hybrid_shard"]:
        flags.append("--hybrid-shard")
    return flags


def test_training_minimum_per_zero_stage_and_offload_checked_by_estimate_and_recommend(cli):
    stack = ("--stack", "deepspeed")  # DeepSpeed offers every ZeRO stage and ZeRO-Offload/Infinity
    d = _json(cli("capacity", MODEL, "--hardware", HW, "--workload", "training", *stack, "--json"))
    assert (d["workload"], d["seq_len"], d["global_batch_size"], d["stack"]) == ("training", 4096, 512, "deepspeed")
    rows = {(r["zero_stage"], r["offload"]): r for r in d["rows"]}
    # all-cpu / all-nvme only with ZeRO-3; optimizer offload needs ZeRO 1-3 (deepspeed.ai config-json)
    assert len(rows) == 4 * 3 + 2 - 2
    assert (3, "all-cpu") in rows and (2, "all-cpu") not in rows and (0, "optimizer-cpu") not in rows
    # 16 bytes per parameter of model states: 1.1 TB with no offload needs more than one node
    assert rows[(0, "none")]["min_num_gpus"] > 8 and rows[(0, "none")]["num_nodes"] >= 2
    # ZeRO-Infinity: parameters and optimizer states on the host, one GPU trains it
    assert rows[(3, "all-cpu")]["min_num_gpus"] == 1
    for key in ((0, "none"), (3, "all-cpu"), (1, "optimizer-cpu")):
        row = rows[key]
        est = _json(cli("estimate", MODEL, "--hardware", HW, "--workload", "training", *stack, "--json",
                        *_training_flags(row)))
        assert est["fits"] and est["memory"]["per_gpu_bytes"] == row["per_gpu_bytes"]
        assert est["time"]["step_seconds"] == row["step_seconds"]
    # recommend's own search at the next smaller count finds nothing with no offload
    below = max(c for c in d["gpu_counts_considered"] if c < rows[(0, "none")]["min_num_gpus"])
    rec = _json(cli("recommend", MODEL, "--hardware", HW, "--workload", "training", *stack, "--gpus", str(below),
                    "--zero-stage", "0", "--offload", "none", "--json"), code=3)
    assert rec["top"] == []


def test_training_capacity_lists_only_what_the_stack_runs(cli):
    """The default stack is torchtitan: FSDP2 (ZeRO-3) or DDP, CPU offload only of FSDP2 shards across
    ranks (knowledge/targets.yaml, torchtitan's rules): no optimizer-only offload rows, and its
    offloaded row shards over more than one rank."""
    d = _json(cli("capacity", MODEL, "--hardware", HW, "--workload", "training", "--json"))
    assert d["stack"] == "torchtitan"
    rows = {(r["zero_stage"], r["offload"]): r for r in d["rows"]}
    assert not {off for _, off in rows} & {"optimizer-cpu", "optimizer-nvme", "all-nvme"}
    assert rows[(3, "all-cpu")]["plan"]["dp"] > 1
    for (z, _), r in rows.items():
        if z in (1, 2) and r.get("plan"):
            assert r["plan"]["dp"] == 1  # torchtitan has no ZeRO-1/2 across data-parallel ranks


def test_nothing_within_max_gpus_exits_3_and_says_what_was_not_found(cli):
    d = _json(cli("capacity", "llama-3.1-405b", "--hardware", HW, "--max-gpus", "2", "--json"), code=3)
    assert d["gpu_counts_considered"] == [1, 2]
    for r in d["formats"]:
        assert r["min_num_gpus"] is None and "no layout of up to 2 GPUs holds 1 sequence(s) of 8,192 tokens" in r["not_found"]
    res = cli("capacity", "llama-3.1-405b", "--hardware", HW, "--max-gpus", "2")
    assert res.exit_code == 3 and "int4: no layout of up to 2 GPUs holds" in " ".join(res.stdout.split())


def test_concurrency_beyond_max_num_seqs_is_bad_input(cli):
    # vLLM >= 0.9 runs 1,024 sequences by default on an H100 (>= 70 GiB, not an A100), 256 on an L4.
    res = cli("capacity", MODEL, "--concurrency", "2048", "--json")
    assert res.exit_code == 2 and res.stdout == ""
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "default max_num_seqs on this GPU (1024)" in lines[0] and "--max-num-seqs 2048" in lines[0]
    small = cli("capacity", "llama-3.1-8b", "--hardware", "l4-24gb", "--concurrency", "512", "--json")
    assert small.exit_code == 2 and "(256)" in small.stderr
    old = cli("capacity", "llama-3.1-8b", "--concurrency", "512", "--engine-version", "0.8.5", "--json")
    assert old.exit_code == 2 and "vLLM 0.8.5's default max_num_seqs on this GPU (256)" in old.stderr
    # Past what --max-num-seqs accepts (2**24), the fix names that limit, not a value it refuses.
    huge = cli("capacity", MODEL, "--concurrency", str(10**9), "--json")
    assert huge.exit_code == 2 and "--max-num-seqs 1000000000" not in huge.stderr
    assert "give --concurrency at most 16777216" in huge.stderr
    edge = cli("capacity", MODEL, "--concurrency", str(2**24), "--json")
    assert edge.exit_code == 2 and f"add --max-num-seqs {2**24}" in edge.stderr


def test_table_shows_the_answer_and_the_quantization_line(cli):
    res = cli("capacity", MODEL, "--hardware", HW)
    assert res.exit_code == 0, res.stderr
    text = " ".join(res.stdout.split())  # the console wraps lines at its width
    assert "fp8 weights fit on one GPU: quantization removes the need to shard (bf16 needs 2 GPUs)" in text
