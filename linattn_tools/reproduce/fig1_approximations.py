"""The approximations of softmax self-attention that Skyformer's Fig. 1 compares (§4.5), as pure tensor functions.

Measuring instruments of the reproduction ledger, not attention variants of the library: each takes
q, k (..., N, p) and v (..., N, Dv), materialises whatever it needs in the inputs' dtype (float64 in
the ledger) and returns its approximation of softmax attention's output
``softmax(Q K^T / sqrt(p)) V`` (..., N, Dv). ``d`` is what Fig. 1 calls the number of features.
Every exponent is shifted by a constant that cancels in the output (no overflow in float64).

- ``softmax_output``: the target, softmax self-attention (Vaswani et al. 2017), materialised.
- ``skyformer_caption_output``: "Skyformer" as Fig. 1's caption defines it: Eq. (5) of Skyformer
  applied to the raw score matrix A = exp(Q K^T / sqrt(p)) (through its PSD completion over [Q; K],
  Eq. (4), and the off-diagonal block, Eq. (6)), then the normaliser D = diag(Ã 1) taken from the
  approximated Ã, as Performer does.
- ``performer_output``: Performer's positive random features (FAVOR+, Choromanski et al., ICLR 2021,
  Lemma 1): exp(q·k) = E_w[exp(w·q - |q|²/2) exp(w·k - |k|²/2)], w ~ N(0, I_p), d features.
- ``nystromformer_output``: Nyströmformer (Xiong et al., AAAI 2021, Eq. (14)): landmarks are the means
  of d contiguous segments of Q and of K; softmax(Q K̃^T) softmax(Q̃ K̃^T)^+ softmax(Q̃ K^T) V, the
  pseudo-inverse by the paper's 6 iterations (Eq. (15), its default), or exactly.
- ``linformer_output``: Linformer (Wang et al. 2020, Eq. (7)) with random projections E, F (d x N) of
  N(0, 1/d) entries in place of learned ones: softmax(Q (E K)^T / sqrt(p)) (F V).
"""
import math
from typing import Optional

import torch
from torch import Tensor


def softmax_output(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """softmax(Q K^T / sqrt(p)) V, materialised (the target every approximation aims at)."""
    return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1) @ v


def _pinv_psd(m: Tensor) -> Tensor:
    return torch.linalg.pinv(m, hermitian=True)


def skyformer_caption_output(q: Tensor, k: Tensor, v: Tensor, d: int,
                             generator: Optional[torch.Generator] = None) -> Tensor:
    """Skyformer Fig. 1's "Skyformer": Eq. (5) on the raw score matrix, then the normaliser.

    The kernel phi(x, y) = exp(x·y / sqrt(p)) is PSD, so its matrix over the 2N rows X = [Q; K] is the
    completion B̄ of A = exp(Q K^T / sqrt(p)) (Eq. (4)). S picks d of the 2N rows uniformly (without
    replacement); Eq. (5): B̃ = B̄ S (S^T B̄ S)^+ S^T B̄, whose upper-right block (Eq. (6)) is
    Ã = C_Q W^+ C_K^T with C_Q = phi(Q, X_S), C_K = phi(K, X_S), W = phi(X_S, X_S). The output is
    diag(Ã 1)^-1 Ã V ("first approximate A, then D, as Performer does"), never forming Ã.
    """
    n, p = q.shape[-2], q.shape[-1]
    x = torch.cat([q, k], dim=-2)
    idx = torch.randperm(2 * n, generator=generator)[:d].to(q.device)
    land = x[..., idx, :]
    # one shift for the whole kernel matrix: Ã scales by the same constant, which the normaliser cancels
    logits_q = q @ land.transpose(-1, -2) / math.sqrt(p)
    logits_k = k @ land.transpose(-1, -2) / math.sqrt(p)
    logits_w = land @ land.transpose(-1, -2) / math.sqrt(p)
    shift = torch.maximum(torch.maximum(logits_q.amax((-1, -2), keepdim=True),
                                        logits_k.amax((-1, -2), keepdim=True)),
                          logits_w.amax((-1, -2), keepdim=True))
    c_q, c_k, w = (torch.exp(t - shift) for t in (logits_q, logits_k, logits_w))
    middle = _pinv_psd(w)
    ones = torch.ones(*v.shape[:-1], 1, dtype=v.dtype, device=v.device)
    ctx = middle @ (c_k.transpose(-1, -2) @ torch.cat([v, ones], dim=-1))
    out = c_q @ ctx
    return out[..., :-1] / out[..., -1:]


def performer_features(x: Tensor, w: Tensor) -> Tensor:
    """Positive random features phi(x) = exp(w·x - |x|²/2) / sqrt(d) (FAVOR+, Lemma 1), unshifted:
    E[phi(q)·phi(k)] * d / d = exp(q·k) for rows w ~ N(0, I_p) of the (d, p) matrix w."""
    return torch.exp(x @ w.transpose(-1, -2) - (x * x).sum(-1, keepdim=True) / 2) / math.sqrt(w.shape[-2])


def gaussian_features(d: int, p: int, *, orthogonal: bool, dtype=torch.float64,
                      generator: Optional[torch.Generator] = None) -> Tensor:
    """d rows w ~ N(0, I_p); ``orthogonal``: blocks of p rows made orthogonal, each row's norm drawn
    as a chi(p) variable (Performer's ORF: every row still marginally N(0, I_p))."""
    g = torch.randn(d, p, generator=generator, dtype=dtype)
    if not orthogonal:
        return g
    blocks = []
    for start in range(0, d, p):
        rows = min(p, d - start)
        block, r = torch.linalg.qr(torch.randn(p, p, generator=generator, dtype=dtype))
        block = block * torch.sign(r.diagonal())  # the sign fix that makes Q Haar-distributed
        blocks.append(block.T[:rows])
    norms = torch.randn(d, p, generator=generator, dtype=dtype).norm(dim=-1, keepdim=True)
    return torch.cat(blocks) * norms


def performer_output(q: Tensor, k: Tensor, v: Tensor, d: int, generator: Optional[torch.Generator] = None,
                     orthogonal: bool = True) -> Tensor:
    """Performer (FAVOR+): D̂^-1 (phi(Q') (phi(K')^T V)) with Q' = Q / p^{1/4}, K' = K / p^{1/4}, so that
    phi(q')·phi(k') estimates exp(q·k / sqrt(p)); D̂ = diag(phi(Q') (phi(K')^T 1)). The features are
    computed with the exponent shifted per query row and by one constant over the keys (both cancel)."""
    p = q.shape[-1]
    w = gaussian_features(d, p, orthogonal=orthogonal, dtype=q.dtype, generator=generator).to(q.device)
    qs, ks = q / p ** 0.25, k / p ** 0.25
    zq = qs @ w.T - (qs * qs).sum(-1, keepdim=True) / 2
    zk = ks @ w.T - (ks * ks).sum(-1, keepdim=True) / 2
    fq = torch.exp(zq - zq.amax(-1, keepdim=True))
    fk = torch.exp(zk - zk.amax((-1, -2), keepdim=True))
    ones = torch.ones(*v.shape[:-1], 1, dtype=v.dtype, device=v.device)
    out = fq @ (fk.transpose(-1, -2) @ torch.cat([v, ones], dim=-1))
    return out[..., :-1] / out[..., -1:]


def segment_means(x: Tensor, d: int) -> Tensor:
    """The means of d contiguous segments of the N rows (Nyströmformer's landmarks; N divisible by d)."""
    n = x.shape[-2]
    if n % d:
        raise ValueError(f"N = {n} is not a multiple of d = {d}")
    return x.reshape(*x.shape[:-2], d, n // d, x.shape[-1]).mean(-2)


def iterative_pinv(a: Tensor, iterations: int = 6) -> Tensor:
    """Nyströmformer's Eq. (15) (Razavi et al.'s iteration): Z <- Z (13 I - A Z (15 I - A Z (7 I - A Z))) / 4,
    from Z_0 = A^T / (max column sum of A · max row sum of A), as the paper's code."""
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    z = a.transpose(-1, -2) / (a.abs().sum(-2).amax(-1) * a.abs().sum(-1).amax(-1))[..., None, None]
    for _ in range(iterations):
        az = a @ z
        z = 0.25 * z @ (13 * eye - az @ (15 * eye - az @ (7 * eye - az)))
    return z


def nystromformer_output(q: Tensor, k: Tensor, v: Tensor, d: int, iterations: Optional[int] = 6) -> Tensor:
    """Nyströmformer, Eq. (14): softmax(Q K̃^T/√p) softmax(Q̃ K̃^T/√p)^+ (softmax(Q̃ K^T/√p) V), where
    Q̃, K̃ are the segment means (d landmarks); the pseudo-inverse by ``iterations`` of Eq. (15) (None:
    exact). With d = N and the exact inverse the landmarks are Q and K and it is exact."""
    scale = 1 / math.sqrt(q.shape[-1])
    ql, kl = segment_means(q, d), segment_means(k, d)
    f = torch.softmax(q @ kl.transpose(-1, -2) * scale, dim=-1)
    a = torch.softmax(ql @ kl.transpose(-1, -2) * scale, dim=-1)
    b = torch.softmax(ql @ k.transpose(-1, -2) * scale, dim=-1)
    inv = torch.linalg.pinv(a) if iterations is None else iterative_pinv(a, iterations)
    return f @ (inv @ (b @ v))


def linformer_output(q: Tensor, k: Tensor, v: Tensor, d: int, generator: Optional[torch.Generator] = None,
                     projections: Optional[Tensor] = None) -> Tensor:
    """Linformer, Eq. (7): softmax(Q (E K)^T / sqrt(p)) (F V). ``projections`` (2, d, N) gives E, F;
    by default both are drawn with N(0, 1/d) entries (a Johnson-Lindenstrauss projection)."""
    n = q.shape[-2]
    if projections is None:
        projections = torch.randn(2, d, n, generator=generator, dtype=q.dtype) / math.sqrt(d)
    e, f = projections.to(q.device, q.dtype)
    return softmax_output(q, e @ k, f @ v)


def spectral_error(approx: Tensor, exact: Tensor) -> Tensor:
    """||approx - exact||_2 (largest singular value) per leading index of (..., N, Dv) outputs."""
    return torch.linalg.matrix_norm(approx - exact, ord=2)
