"""Let fairseq 0.12 load its own checkpoints on torch >= 2.6.

fairseq's ``checkpoint_utils`` calls ``torch.load(f, map_location=...)``; torch >= 2.6 defaults
that to ``weights_only=True``, which rejects the argparse/omegaconf/numpy objects every fairseq
checkpoint holds (fairseq issues #5603, #5610; fixed upstream after 0.12 by passing
``weights_only=False``). We make the same change for fairseq's checkpoint module only: its
``torch`` name is replaced by a view of torch whose ``load`` defaults to ``weights_only=False``.
Nothing else in the process changes. Checkpoints are pickles: load only ones you trust.
"""
import functools
import types

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
    """Idempotent; a no-op when fairseq already passes weights_only itself."""
    from fairseq import checkpoint_utils

    if getattr(checkpoint_utils.torch, "__name__", "") == "torch" and checkpoint_utils.torch is not torch:
        return  # already patched
    checkpoint_utils.torch = _trusting_torch()
