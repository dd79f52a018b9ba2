"""How LLN+Diag mixes its parts (B,H,N,Dv): the average, or per head and channel weights r, p (H, Dv)."""
from typing import Optional

from torch import Tensor

MIX_MODES = ("average", "learnable_scale", "learnable_ratio")


def mix_lln_diag(lln_out: Tensor, diag_out: Tensor, mix: str = "average", r: Optional[Tensor] = None,
                 p: Optional[Tensor] = None) -> Tensor:
    """average: (LLN + Diag)/2; learnable_scale: r*LLN + p*Diag; learnable_ratio: r*LLN + (1-r)*Diag.

    r, p are (H, Dv) (per head and channel), broadcast over batch and tokens.
    """
    if mix not in MIX_MODES:
        raise ValueError(f"mix must be one of {MIX_MODES}, got {mix!r}")
    if mix == "average":
        return 0.5 * (lln_out + diag_out)
    h, dv = lln_out.shape[1], lln_out.shape[-1]
    needed = {"learnable_scale": ("r", "p"), "learnable_ratio": ("r",)}[mix]
    for name, t in (("r", r), ("p", p)):
        if name in needed and (t is None or tuple(t.shape) != (h, dv)):
            raise ValueError(f"mix={mix!r} needs {name} of shape (H, Dv) = {(h, dv)}, "
                             f"got {None if t is None else tuple(t.shape)}")
    r4 = r[None, :, None, :].to(lln_out.dtype)
    if mix == "learnable_scale":
        return r4 * lln_out + p[None, :, None, :].to(lln_out.dtype) * diag_out
    return r4 * lln_out + (1 - r4) * diag_out
