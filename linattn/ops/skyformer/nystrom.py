"""Skyformer's Nyström pieces: the op's arguments checked, landmark rows (B,d) of X = [Q; K], M^-1 (B,H,d,d), kernel
rows against the landmarks (B,H,rows,d), and ``NystromInputs``, what each implementation's ``inputs`` gives."""
from typing import NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from ..inputs import check_key_padding_mask, check_positive_int, check_qkv
from ..kernelized.kernel import check_non_causal, gaussian_kernel, kernel_scale
from ..precision import compute_dtype
from .inverse import kernel_inverse

MODES = ("stratified", "uniform")
GAMMA = 0.1  # ridge added to kappa(L, L) (Skyformer §4.4)
_WHAT = "Gaussian-kernel Nyström attention over the whole sequence"


class LandmarkChoice(NamedTuple):
    """How the landmarks are drawn: ``num_landmarks`` d, ``mode`` (``MODES``), ``generator`` for the random draws, and
    ``training`` (a random subset redrawn each call; else evenly spaced valid rows)."""
    num_landmarks: int
    mode: str
    generator: Optional[torch.Generator]
    training: bool


class Landmarks(NamedTuple):
    """The landmark rows of X = [Q; K]: idx (B,d) long and used (B,d) bool (an unused slot is inert)."""
    idx: Tensor
    used: Tensor


class KernelColumns(NamedTuple):
    """What the kernel rows against the landmarks take: D^(-1/4), the landmarks L (B,H,d,D), the used slots as
    (B,1,1,d) factors in L's dtype, the padding (B,N) or None."""
    scale: float
    land: Tensor
    used: Tensor
    pad: Optional[Tensor]


class NystromInputs(NamedTuple):
    """The Nyström apply's inputs (Skyformer eq. 6), as an implementation's ``inputs`` gives them; the fields it does
    not take are None (the tensors come first, then the constants).

    Both: v (B,H,N,Dv); land (B,H,d,D), the landmarks L (rows of X = [Q; K] scaled by D^(-1/4)), and m_inv (B,H,d,d),
    M^-1, in the compute dtype; pad (B,N) or None.
    ``looped`` (compute dtype; L and M^-1 made without autograd, its backward takes their gradient): q, k (B,H,N,D),
    padded keys 0; idx (B,d) the landmark rows of X and used (B,d) bool their slots in use; gamma and exact_inverse,
    with which its backward rebuilds M^-1's graph.
    ``parallel`` (the inputs' own dtype; L and M^-1 made under autograd, which carries their gradient on): qk = X
    (B,H,2N,D); used_cols (B,1,1,d), 1 or 0 per slot in the compute dtype; pad2 = [pad, pad] (B,2N) or None.

    A backward's gradients come in the same tuple (None where there is none).
    """
    v: Optional[Tensor] = None
    land: Optional[Tensor] = None
    m_inv: Optional[Tensor] = None
    pad: Optional[Tensor] = None
    q: Optional[Tensor] = None
    k: Optional[Tensor] = None
    idx: Optional[Tensor] = None
    used: Optional[Tensor] = None
    qk: Optional[Tensor] = None
    used_cols: Optional[Tensor] = None
    pad2: Optional[Tensor] = None
    gamma: Optional[float] = None
    exact_inverse: Optional[bool] = None


NYSTROM_TENSORS = NystromInputs._fields.index("gamma")  # the tensor fields of ``NystromInputs``: the first ones


def check_skyformer(q, k, v, key_padding_mask, choice: LandmarkChoice, causal, gamma) -> Optional[Tensor]:
    """Raise ``ValueError`` for a bad argument; the checked ``key_padding_mask``."""
    check_non_causal("skyformer", _WHAT, causal)
    check_qkv(q, k, v)
    key_padding_mask = check_key_padding_mask(key_padding_mask, k)
    check_positive_int("num_landmarks", choice.num_landmarks)
    if choice.mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(repr(m) for m in MODES)}, got {choice.mode!r}")
    if choice.generator is not None and not isinstance(choice.generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator or None, got {type(choice.generator).__name__}")
    if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not 0.0 <= gamma < float("inf"):
        raise ValueError(f"gamma must be a finite float >= 0, got {gamma!r}")
    return key_padding_mask


def _pick_rows(valid: Tensor, count: int, generator: Optional[torch.Generator],
               training: bool) -> Tuple[Tensor, Tensor]:
    """Choose min(count, R) of the R rows per batch element among the valid ones, without replacement.

    valid (B,R) bool -> (idx (B,m) long, used (B,m) bool); a slot is unused when the element has fewer
    than m valid rows (its index then points at an arbitrary row).
    """
    b, r = valid.shape
    m = min(count, r)
    if training:
        # no generator keyword without a generator: torch.compile cannot trace rand(..., generator=None) at a
        # dynamic size (the modules' draws, under --attention-compile)
        scores = (torch.rand(b, r, device=valid.device) if generator is None
                  else torch.rand(b, r, generator=generator, device=generator.device).to(valid.device))
        top, idx = scores.masked_fill(~valid, -1.0).topk(m, dim=1)  # random keys: a uniform m-subset
        return idx, top >= 0
    n = valid.sum(1, keepdim=True)  # (B,1) valid rows per element
    valid_first = torch.argsort((~valid).to(torch.uint8), dim=1, stable=True)  # valid row positions, in order
    slot = torch.arange(m, device=valid.device)[None, :]
    rank = torch.where(n >= m, ((2 * slot + 1) * n) // (2 * m), slot)  # evenly spaced ranks, distinct when n >= m
    return valid_first.gather(1, rank.clamp_max(r - 1)), slot < n


def _landmark_indices(valid: Tensor, num_landmarks: int, mode: str, generator, training: bool):
    """Row indices into X = [Q; K] (B,m) and their used-flags (B,m); valid (B,N) marks non-padded tokens."""
    n = valid.shape[1]
    if mode == "uniform":
        return _pick_rows(torch.cat([valid, valid], dim=1), num_landmarks, generator, training)
    from_q = num_landmarks - num_landmarks // 2
    idx_q, used_q = _pick_rows(valid, from_q, generator, training)
    if num_landmarks // 2 == 0:
        return idx_q, used_q
    idx_k, used_k = _pick_rows(valid, num_landmarks // 2, generator, training)
    return torch.cat([idx_q, idx_k + n], dim=1), torch.cat([used_q, used_k], dim=1)


def landmark_rows(q: Tensor, key_padding_mask: Optional[Tensor], choice: LandmarkChoice) -> Landmarks:
    """The landmark rows of [Q; K] among the non-padded tokens."""
    b, _, n, _ = q.shape
    valid = torch.ones(b, n, dtype=torch.bool, device=q.device) if key_padding_mask is None else ~key_padding_mask
    return Landmarks(*_landmark_indices(valid, choice.num_landmarks, choice.mode, choice.generator, choice.training))


def upcast_qk(q: Tensor, k: Tensor, key_padding_mask: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """q, k in the compute dtype, padded keys 0 (whatever they held, even inf)."""
    ct = compute_dtype(q)
    q_, k_ = q.to(ct), k.to(ct)
    if key_padding_mask is not None:
        k_ = k_.masked_fill(key_padding_mask[:, None, :, None], 0.0)
    return q_, k_


def gather_landmarks(q: Tensor, k: Tensor, idx: Tensor, key_padding_mask: Optional[Tensor]) -> Tensor:
    """Rows idx (B,m) of X = [Q; K] scaled by D^(-1/4) (eq. 4) in the compute dtype, gathered without forming X:
    (B,H,m,D).

    Padded rows count as 0 (an unused slot may point at one).
    """
    b, h, n, dim = q.shape
    m = idx.shape[1]
    pick = lambda x, i: x.gather(2, i[:, None, :, None].expand(b, h, m, dim))
    land = torch.where((idx < n)[:, None, :, None], pick(q, idx.clamp_max(n - 1)), pick(k, (idx - n).clamp_min(0)))
    land = land.to(compute_dtype(q)) * kernel_scale(q)  # half rows scaled in fp32
    if key_padding_mask is not None:
        land = land.masked_fill(key_padding_mask.gather(1, idx % n)[:, None, :, None], 0.0)
    return land


def _keep(used: Tensor, like: Tensor) -> Tuple[Tensor, Tensor]:
    """I (d,d) in like's dtype, and which entries of kappa(L, L) M keeps (B,1,d,d) bool: pairs of used slots and the
    diagonal (an unused slot is an inert identity block)."""
    eye = torch.eye(used.shape[1], dtype=like.dtype, device=like.device)
    return eye, (used[:, :, None] & used[:, None, :])[:, None] | eye.bool()


def landmark_inverse(land: Tensor, used: Tensor, gamma: float, exact_inverse: bool) -> Tensor:
    """M^-1 (B,H,d,d) for M = kappa(L, L) + gamma I (Skyformer §4.4); unused slots an inert identity block."""
    eye, keep = _keep(used, land)
    if not exact_inverse:
        return kernel_inverse(land, keep, gamma)
    m = gaussian_kernel(land, land) * keep + gamma * eye  # M = kappa(L, L) + gamma I
    return torch.linalg.pinv(m, hermitian=True)


def landmark_inverse_grad(land: Tensor, used: Tensor, gamma: float, exact_inverse: bool, grad: Tensor) -> Tensor:
    """dL/dL (B,H,d,D) through M^-1 from dL/dM^-1 (B,H,d,d), through M^-1's small (d×d) graph, rebuilt."""
    with torch.enable_grad():
        lg = land.detach().requires_grad_()
        return torch.autograd.grad(landmark_inverse(lg, used, gamma, exact_inverse), lg, grad)[0]


def add_landmark_grads(dq: Tensor, dk: Tensor, dland: Tensor, idx: Tensor, pad: Optional[Tensor]) -> None:
    """Add dL/dL (B,H,d,D), the gradient of ``gather_landmarks``' rows, into the rows of dq, dk (B,H,N,D) they came
    from, in place and in their dtype: no dense gradient of a gather. Rows padded in ``pad`` (B,N) get nothing."""
    b, h, n, dim = dq.shape
    dland = dland * kernel_scale(dq)  # L = X[idx] * D^(-1/4) (eq. 4)
    if pad is not None:
        dland = dland.masked_fill_(pad.gather(1, idx % n)[:, None, :, None], 0.0)
    from_q = (idx < n)[:, None, :, None]
    rows = lambda i: i[:, None, :, None].expand(b, h, idx.shape[1], dim)
    dq.scatter_add_(2, rows(idx.clamp_max(n - 1)), torch.where(from_q, dland, 0.0).to(dq.dtype))
    dk.scatter_add_(2, rows((idx - n).clamp_min(0)), torch.where(from_q, 0.0, dland).to(dk.dtype))


def kernel_rows(x: Tensor, cols: KernelColumns, r0: int, r1: int, zero_padded: bool = False, inplace: bool = True):
    """(x_s, C) for rows [r0, r1): x_s = x * D^(-1/4) (0 on padded rows), C = kappa(x_s, L) * used (B,H,rows,d),
    with zero rows for padded tokens if ``zero_padded`` (the keys). ``inplace=False`` where autograd records."""
    xs = x[:, :, r0:r1] * cols.scale
    if cols.pad is None:
        c = gaussian_kernel(xs, cols.land)
        return xs, c.mul_(cols.used) if inplace else c * cols.used
    rows = cols.pad[:, None, r0:r1, None]
    xs = xs.masked_fill_(rows, 0.0) if inplace else xs.masked_fill(rows, 0.0)
    c = gaussian_kernel(xs, cols.land)
    c = c.mul_(cols.used) if inplace else c * cols.used
    if not zero_padded:
        return xs, c
    return xs, c.masked_fill_(rows, 0.0) if inplace else c.masked_fill(rows, 0.0)
