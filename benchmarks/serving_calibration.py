"""A host's compute rate fitted to one of its published serving runs, and its other runs predicted
with it (`shardplan calibrate --serving-run`; tests/golden/test_serving_calibration_published.py
holds the same split). Run from the repository root:

    python benchmarks/serving_calibration.py     # the Markdown tables for BENCHMARKS.md

First table: every prompt-bound burst of the corpus (all requests at once, prompts of 1,500 tokens
or more, outputs of 250 or fewer), measured output throughput over the shipped profile's
prediction. Second: for each fitted page, each of its runs' errors on the shipped profile and on the
calibrated one.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "golden"))

import serving_load_cases as S  # noqa: E402

from shardplan.specs.loading import load_hardware  # noqa: E402
from shardplan.tasks.calibrate import calibrate_profile_from_serving_run  # noqa: E402
from shardplan.validation.predict import predict_serving_load, serving_load_inputs  # noqa: E402

FITTED = {"gpustack-qwen3-14b-h100-vllm-09": "qwen3-14b-h100", "gpustack-gpt-oss-120b-h100-vllm-10": "gpt-oss-120b-h100"}


def main() -> None:
    cases = {}
    for c in S.cases():
        try:
            cases[c.id] = (c, S.predict(c))
        except S.NotModelled:
            continue
    print("| run | engine | GPUs | mean prompt / output tokens | requests | output tok/s measured / predicted | measured / predicted |")
    print("|---|---|---|---|---:|---:|---:|")
    for c, r in cases.values():
        reqs = serving_load_inputs(c, S.CORPUS_DIR)[4].requests
        pin, pout = (sum(x[i] for x in reqs) / len(reqs) for i in (0, 1))
        if c.max_concurrency is None and pin >= 1500 and pout <= 250:
            print(f"| {c.id} | {c.engine} {c.engine_version} | {c.tp}x {c.hardware} | {pin:,.0f} / {pout:,.0f} | {len(reqs)} | "
                  f"{c.measured.output_tokens_per_second:,.0f} / {r.output_tokens_per_second:,.0f} | "
                  f"{c.measured.output_tokens_per_second / r.output_tokens_per_second:.2f} |")
    print()
    with tempfile.TemporaryDirectory() as tmp:
        for fitted, page in FITTED.items():
            c = cases[fitted][0]
            run = c.model_dump(mode="json", exclude_none=True)
            run["model"] = str(S.CORPUS_DIR / run["model"])
            (Path(tmp) / "run.yaml").write_text(yaml.safe_dump({"cases": [run]}))
            res = calibrate_profile_from_serving_run(Path(tmp) / "run.yaml", Path(tmp) / f"{page}.yaml")
            hw = load_hardware(str(Path(tmp) / f"{page}.yaml"))
            print(f"Fitted to {fitted}: gpu.power_limited_compute_fraction {res.changes[0].new:.4f}.")
            print()
            print("| run | load | err TTFT shipped / calibrated | err TPOT | err output tok/s |")
            print("|---|---|---:|---:|---:|")
            within = {"shipped": [], "calibrated": []}
            for cid, (case, before) in cases.items():
                if cid == fitted or not cid.startswith(fitted.rsplit("-", 2)[0]):
                    continue
                after = predict_serving_load(case, S.CORPUS_DIR, hw)[0]
                eb, ea = S.errors(case, before), S.errors(case, after)
                for name, e in (("shipped", eb), ("calibrated", ea)):
                    within[name].append(abs(e["median_tpot"]) <= 0.2 and abs(e["output_throughput"]) <= 0.15
                                        and abs(e["median_ttft"]) <= 0.2)
                load = "rate inf" if case.max_concurrency is None else f"c={case.max_concurrency}"
                print(f"| {cid} | {load} | {eb['median_ttft']:+.0%} / {ea['median_ttft']:+.0%} | "
                      f"{eb['median_tpot']:+.0%} / {ea['median_tpot']:+.0%} | "
                      f"{eb['output_throughput']:+.0%} / {ea['output_throughput']:+.0%} |")
            n = len(within["shipped"])
            print()
            print(f"- held-out runs within all three tolerances (TTFT 20%, TPOT 20%, output 15%): shipped profile "
                  f"{sum(within['shipped'])}/{n}, calibrated {sum(within['calibrated'])}/{n}")
            print()


if __name__ == "__main__":
    main()
