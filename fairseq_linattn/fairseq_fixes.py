"""The fixes that fairseq 0.12 (fairseq-fixed 0.12.3.1) needs on today's torch and NumPy, applied together
by ``apply_fairseq_fixes`` when the plugin is imported (tests/plugin/test_fairseq_fixes.py checks that each is still
needed and still works).

1. Checkpoints on torch >= 2.6: fairseq's ``checkpoint_utils`` calls ``torch.load(f, map_location=...)``;
torch >= 2.6 defaults
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

3. ``--bf16`` without torch_xla: fairseq 0.12's ``options.parse_args_and_arch`` turns ``--bf16`` into ``--tpu``
(bf16 was TPU-only then); with no torch_xla installed that path can only crash (``'NoneType' object has no
attribute 'xla_device'``). After parsing, ``--tpu`` implied by ``--bf16`` is turned off again when torch_xla is
missing, so bf16 trains on the CPU or GPU.
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


def _has_torch_xla() -> bool:
    try:
        import torch_xla  # noqa: F401
    except ImportError:
        return False
    return True


def bf16_without_xla() -> None:
    """Idempotent: ``fairseq.options.parse_args_and_arch`` keeps ``--tpu`` off for ``--bf16`` without torch_xla."""
    from fairseq import options

    parse = options.parse_args_and_arch
    if getattr(parse, "linattn_bf16_without_xla", False):
        return

    @functools.wraps(parse)
    def parse_args_and_arch(*args, **kwargs):
        parsed = parse(*args, **kwargs)
        namespace = parsed[0] if isinstance(parsed, tuple) else parsed
        if getattr(namespace, "bf16", False) and getattr(namespace, "tpu", False) and not _has_torch_xla():
            namespace.tpu = False
        return parsed

    parse_args_and_arch.linattn_bf16_without_xla = True
    options.parse_args_and_arch = parse_args_and_arch


def apply_fairseq_fixes() -> None:
    """Idempotent: the three fixes above."""
    allow_fairseq_checkpoints()
    restore_numpy_compat_long()
    bf16_without_xla()
