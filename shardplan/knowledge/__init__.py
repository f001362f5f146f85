"""What engines (and, later, training stacks) do, by version: sourced data the cost model's
inputs are resolved from. `schema.py` is pure pydantic; `load.py` reads `engines/*.yaml`.

Rules (tests/test_architecture.py): knowledge imports nothing from cost, search, plan,
exporters, tasks, verify or cli; `schema.py` imports no yaml, rich or typer.
"""
