"""Counts the ATen ops a piece of code dispatches: each non-view op is at least one kernel launch on a GPU,
and each host sync (``Tensor.item``, ``bool(t)``, boolean-mask indexing) stalls the stream until the GPU catches
up. The attention benchmark's "ATen ops launched" column (``attention``) and the tests' op budgets count with it; the
developer tools (``dev/perf``) too."""
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

from torch.utils._python_dispatch import TorchDispatchMode

# ops that read a tensor's values on the host (docs/design.md §1.3)
SYNC_OPS = frozenset({"_local_scalar_dense", "nonzero", "equal", "is_nonzero", "item", "masked_select", "unique_dim",
                      "_unique2", "unique_consecutive", "repeat_interleave"})


def _is_view(func) -> bool:
    return bool(func._schema.returns) and all(
        r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)


@dataclass
class DispatchCounts:
    """``ops``: launched (non-view) ATen ops by name; ``views``: view ops (no launch); ``syncs``: host syncs."""

    ops: Counter = field(default_factory=Counter)
    views: Counter = field(default_factory=Counter)
    syncs: Counter = field(default_factory=Counter)

    @property
    def launched(self) -> int:
        return sum(self.ops.values())

    @property
    def host_syncs(self) -> int:
        return sum(self.syncs.values())


class _Counter(TorchDispatchMode):
    def __init__(self, counts: DispatchCounts):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in SYNC_OPS:
            self.counts.syncs[name] += 1
        (self.counts.views if _is_view(func) else self.counts.ops)[name] += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def count_dispatch():
    """``with count_dispatch() as counts:`` every ATen op run inside (forward and autograd backward) is counted."""
    counts = DispatchCounts()
    with _Counter(counts):
        yield counts
