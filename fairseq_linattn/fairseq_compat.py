"""Two fixes that fairseq 0.12 (fairseq-fixed 0.12.3.1) needs on today's torch and NumPy.

1. Checkpoints on torch >= 2.6: fairseq's ``checkpoint_utils`` calls ``torch.load(f, map_location=...)``; torch >= 2.6 defaults
that to ``weights_only=True``, which rejects the argparse/omegaconf/numpy objects every fairseq
checkpoint holds (fairseq issues #5603, #5610; fixed upstream after 0.12 by passing
``weights_only=False``). In a distributed run only rank 0 reads the file and
``distributed.utils.broadcast_object`` sends the state to the other ranks as a ``torch.save``
pickle, unpickled there by ``torch.load`` again. We make the upstream change in these two modules
only: their ``torch`` name is replaced by a view of torch whose ``load`` defaults to
``weights_only=False``. Nothing else in the process changes. Checkpoints are pickles: load only
ones you trust.

2. NumPy >= 2 removed ``np.compat``; fairseq still reads ``np.compat.long`` when it builds a
``TokenBlockDataset`` from a list of sizes (hub ``generate``/``sample``, ``fairseq-interactive`` on a
language model) and in ``LanguagePairDataset``. We give ``numpy`` back that one alias (``np.int64``,
what ``np.compat.long`` was on 64-bit platforms) if it is missing.
"""
import functools
import types

import numpy as np
import torch


def _trusting_torch() -> types.ModuleType:
    view = types.ModuleType("torch", "torch, with load(weights_only=False) by default (fairseq checkpoints)")
    view.__dict__.update({k: v for k, v in vars(torch).items() if not k.startswith("__")})

    @functools.wraps(torch.load)
    def load(*args, **kwargs):
        kwargs.setdefault("weights_only", False)
        return torch.load(*args, **kwargs)

    view.load = load
    view.__getattr__ = lambda name: getattr(torch, name)  # submodules imported later
    return view


def allow_fairseq_checkpoints() -> None:
    """Idempotent: fairseq's checkpoint loader and its object broadcast get ``weights_only=False``."""
    from fairseq import checkpoint_utils
    from fairseq.distributed import utils as distributed_utils

    for module in (checkpoint_utils, distributed_utils):
        if module.torch is torch:  # not patched yet
            module.torch = _trusting_torch()


def restore_numpy_compat_long() -> None:
    """Idempotent; a no-op on NumPy < 2, which still has ``np.compat``."""
    if not hasattr(np, "compat"):
        np.compat = types.SimpleNamespace(long=np.int64)


def bf16_without_xla(args) -> None:
    """``--bf16`` without torch_xla: train in bfloat16 on CPU/GPU instead of failing on a missing TPU.

    fairseq 0.12's option parser turns ``--bf16`` into ``--tpu`` (bf16 was TPU-only then); with no
    torch_xla installed that path can only crash (``'NoneType' object has no attribute
    'xla_device'``). Architecture functions run after that line, so ours call this.
    """
    if getattr(args, "bf16", False) and getattr(args, "tpu", False):
        try:
            import torch_xla  # noqa: F401
        except ImportError:
            args.tpu = False
