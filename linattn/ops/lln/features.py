"""Helpers shared by LLN's forms and its decoding: [v, 1] columns, safe division, non-finite shifts to 0."""
import torch
import torch.nn.functional as F
from torch import Tensor

_TINY = 1e-30


def _finite_or_zero(x: Tensor) -> Tensor:
    return torch.nan_to_num(x, 0.0, 0.0, 0.0)


def _divide(o: Tensor) -> Tensor:
    """[numerator, denominator] -> numerator / denominator; 0 where no key was visible."""
    return o[..., :-1] / o[..., -1:].clamp_min(_TINY)


def _with_ones(v: Tensor) -> Tensor:
    """[v, 1]: the last column turns every value sum into the matching denominator sum."""
    return F.pad(v, (0, 1), value=1.0)
