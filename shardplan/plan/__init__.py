"""The deployment manifest: its schema (`schema.py`), building, writing and loading it
(`manifest.py`), reading a plan file back into the model, hardware, workload and layout it
stands for (`readback.py`, the one place that does so), and which rank holds which slice of
which tensor (`placement.py`).

Rules (tests/test_architecture.py): `schema.py` and `readback.py` import no yaml, rich or
typer; nothing here imports `tasks`, `cli` or torch.
"""
