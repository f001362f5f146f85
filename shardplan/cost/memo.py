"""One switch for the search's exact shortcuts (issue 25: every search under a second).

The search takes shortcuts that change how much work it does, never what it finds:
  - serving: each distinct stage make-up of a pass is costed once (`time_serving.pass_time`),
    each layer kind at one representative layer (`compute.kinds_forward`); a replica's memory
    and time are costed once across the GPU counts of `--max-gpus` (`search/serving.py`);
  - training: a per-stage memory verdict before the full memory model
    (`memory_training.training_memory_unless_over_gpu`);
  - goodput: a replica whose bound on goodput cannot reach the top plans is not simulated
    (`search/serving.py`, `_goodput_bound`).
`reference_path()` turns them all off, so that a test can run the search both ways in one
process and compare the rankings (tests/search/test_search_memo.py, test_goodput_bound.py). Pure caches of pure
functions (`lru_cache`) stay on either way: they cannot change a result; `hash_once` below
makes the frozen inputs cheap to look up in them.
"""

from __future__ import annotations

import dataclasses
import operator
import weakref
from contextlib import contextmanager
from typing import Any, Iterator, TypeVar

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


T = TypeVar("T")


def hash_once(cls: type[T]) -> type[T]:
    """Class decorator for frozen dataclasses used as cache keys: the hash of the fields is
    computed once per instance and kept (dataclass's own `__hash__` builds and hashes the tuple
    of every field on each lookup; the cost model looks workloads and layouts up hundreds of
    thousands of times a search). Equal instances have equal fields, so equal hashes. The hash
    is kept beside the instance, by its id while it lives, not in it: its `__dict__` (which some
    code reads field by field), its pickle and its copies stay as they were."""
    values = operator.attrgetter(*(f.name for f in dataclasses.fields(cls)))  # type: ignore[arg-type]

    def __hash__(self: Any) -> int:
        key = id(self)
        kept = _HASHES.get(key)
        if kept is not None and kept[0]() is self:
            return kept[1]
        h = hash(values(self))
        _HASHES[key] = (weakref.ref(self, lambda _, key=key: _HASHES.pop(key, None)), h)
        return h

    cls.__hash__ = __hash__  # type: ignore[method-assign,assignment]
    return cls


# id -> (a weak reference to the instance, its hash); an entry leaves when its instance dies,
# before the id can be given to another object.
_HASHES: dict[int, tuple[weakref.ref[Any], int]] = {}
