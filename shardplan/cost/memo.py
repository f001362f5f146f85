"""One switch for the search's exact shortcuts (issue 25: every search under a second).

The search takes shortcuts that change how much work it does, never what it finds:
  - serving: each distinct stage make-up of a pass is costed once (`time_serving.pass_time`);
    a replica's memory and time are costed once across the GPU counts of `--max-gpus`
    (`search/serving.py`);
  - training: a per-stage memory verdict before the full memory model
    (`memory_training.exceeds_gpu_memory`); degree sets are bounded when the branch and bound
    reaches them, not all up front (`search/training.py`).
`reference_path()` turns them all off, so that a test can run the search both ways in one
process and compare the rankings (tests/search/test_search_memo.py). Pure caches of pure
functions (`lru_cache`) stay on either way: they cannot change a result.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

ENABLED = True  # read at call time; False: the reference path


@contextmanager
def reference_path() -> Iterator[None]:
    """Run the enclosed search without the shortcuts above."""
    global ENABLED
    before = ENABLED
    ENABLED = False
    try:
        yield
    finally:
        ENABLED = before
