"""`shardplan verify`: run a plan for real with torch.distributed and compare what it measures
with what the cost model predicted. `launch` starts the ranks (no torch), `worker` is one
rank (torch, imported only there), `compare` is pure, `runspec` decides what runs.

Rules (tests/test_architecture.py): the only package that imports torch, and only in the
modules that run inside a rank; no import circles (the run-dir constant lives in `runspec`,
which both `launch` and `worker` import)."""
