"""The pure cost model: specs + layout + workload -> per-GPU memory and time (`estimate`).

Rules (tests/test_architecture.py): no file, terminal or network I/O; imports no yaml, rich,
typer or torch, and nothing from `search`, `plan`, `exporters`, `tasks`, `verify` or `cli`.
Every estimate is a named breakdown whose parts sum to its total.
"""
