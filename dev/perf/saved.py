"""Bytes held between forward and backward: the storages of every tensor autograd saves, each counted once."""
from contextlib import contextmanager

import torch


@contextmanager
def saved_bytes():
    """``with saved_bytes() as held:`` after the block, ``held["bytes"]`` is the bytes of the distinct storages
    saved for backward by the code inside (views of one storage count once)."""
    held, seen = {"bytes": 0}, set()

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        key = (storage.data_ptr(), t.device) if t.device.type != "meta" else id(storage)
        if key not in seen:
            seen.add(key)
            held["bytes"] += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield held
