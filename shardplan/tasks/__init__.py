"""One use case per command: typed inputs in, a typed result (a frozen pydantic model) out.

Tasks compose specs -> cost -> search -> plan -> exporters. Rules (tests/test_architecture.py):
a task never prints (the CLI renders its result), never imports another task, `cli`,
typer or rich, and never imports torch.
"""
