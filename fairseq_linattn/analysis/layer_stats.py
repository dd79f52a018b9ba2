"""Per-head concentration measures of one attention module on one sequence of a forward's batch.

Used by the training-time recorder (``training_stats``) and the analysis command (``cli``). Cost is
bounded by two budgets: ``max_rows`` query rows (evenly spaced over the sequence's non-padded tokens)
against all its keys for entropy, sparsity and log P; and a ``max_chain`` x ``max_chain`` chain on the
sequence's first non-padded tokens for the spectral gap, which needs a square matrix. For causal
attention that chain is exactly the attention of the prefix; otherwise its rows are renormalised
(the chain conditioned to stay on those tokens). A sequence within both budgets is measured exactly.
"""
from typing import Dict, Optional

import torch
from torch import Tensor

from linattn.analysis.concentration import entropy, log_moments, softmax_temperature, sparsity, spectral_gap
from linattn.ops import lln_attention_weights, softmax_attention_weights
from linattn.ops.moment_matching import lln_alpha_beta


def lln_forward_parameters(module) -> Optional[Dict[str, Tensor]]:
    """alpha, beta, tau (shape (G,)) that an LLN module's matcher used in its last forward, else None."""
    matcher = getattr(module, "matcher", None)
    if matcher is None or matcher.last_alpha is None:
        return None
    return {"alpha": matcher.last_alpha, "beta": matcher.last_beta, "tau": matcher.last_tau}


def _spread(x: Tensor, h: int) -> Tensor:
    """(G,) per-layer or per-head values -> (H,)."""
    return x.reshape(-1).double().expand(h) if x.numel() == 1 else x.reshape(-1).double()


def _gap(C: Tensor, markov: Tensor) -> Tensor:
    """spectral_gap per head (H,), NaN for a single token or a head whose chain is not stochastic."""
    gap = torch.full((C.shape[0],), float("nan"), dtype=torch.float64, device=C.device)
    if C.shape[-1] > 1 and bool(markov.any()):
        gap[markov] = spectral_gap(C[markov]).double()
    return gap


def _comparison(q: Tensor, k: Tensor, rows: Tensor, causal: bool, sigma_q: Tensor, sigma_k: Tensor):
    """var ln(n_i P_ij) of softmax, unmatched LLN and paper-matched LLN on one sequence's q, k (H, n, D)."""
    alpha, beta = lln_alpha_beta(sigma_q, sigma_k)  # LLN eq. 10 with the paper's a, b, per head
    q, k = q[None], k[None]
    matrices = {
        "softmax": softmax_attention_weights(q, k, causal=causal, rows=rows),
        "lln_unmatched": lln_attention_weights(q, k, 1.0, 1.0, causal=causal, rows=rows),
        "lln_paper": lln_attention_weights(q, k, alpha.view(1, -1, 1, 1), beta.view(1, -1, 1, 1), causal=causal,
                                           rows=rows),
    }
    return {f"log_p_rel_var_{name}": log_moments(P[0], relative=True)[1] for name, P in matrices.items()}


@torch.no_grad()
def sequence_statistics(module, q: Tensor, k: Tensor, key_padding_mask: Optional[Tensor], b: int, *,
                        max_rows: int = 512, max_chain: int = 512, lln: Optional[Dict[str, Tensor]] = None,
                        log_p_samples: int = 0, generator: Optional[torch.Generator] = None,
                        compare: bool = False) -> Dict[str, Tensor]:
    """Measures of sequence ``b`` of the module's projected q, k (B, H, N, D); each (H,) float64.

    Keys: entropy (bits, LLN eq. 7), entropy_max (the same for uniform rows over the visible keys),
    spectral_gap (NaN for a single token), sparsity, log_p_mean / log_p_var (raw ln P) and
    log_p_rel_var (ln(n_i P_ij), see ``log_moments``), temperature_softmax (eq. 5 on this head's q, k),
    sigma_q, sigma_k (std of the head's q, k entries); for LLN modules alpha, beta and
    temperature_lln (eq. 11; ``lln`` gives the values of the forward, default: recomputed); for
    kernel methods kernel_row_sum (mean row sum of the kernel before normalising, from the rows).
    ``log_p_samples`` > 0 adds ``log_p_rel`` (1-D): that many random values of ln(n_i P_ij).
    ``compare`` adds what softmax, LLN with alpha = beta = 1 and LLN moment-matched by the paper's
    constants would give on the same q, k rows: ``log_p_rel_var_softmax``, ``log_p_rel_var_lln_unmatched``,
    ``log_p_rel_var_lln_paper`` (LLN Fig. 5b on real inputs; the input variance is sigma_q² sigma_k²).
    """
    h = q.shape[1]
    kpm = None if key_padding_mask is None else key_padding_mask[b:b + 1].bool()
    tokens = torch.arange(q.shape[2], device=q.device) if kpm is None else (~kpm[0]).nonzero()[:, 0]
    n = len(tokens)
    if n == 0:
        raise ValueError(f"sequence {b} has no non-padded token")
    qb, kb = q[b:b + 1], k[b:b + 1]
    if lln is None:
        lln = module.lln_parameters(q, k, key_padding_mask)  # None for methods without alpha, beta
    if lln is not None and torch.as_tensor(lln["alpha"]).dim() == 2:  # per-sequence statistics: sequence b's
        lln = {name: value[b] for name, value in lln.items()}
    rows = tokens if n <= max_rows else tokens[torch.linspace(0, n - 1, max_rows, device=q.device).round().long()]
    P = module.attention_rows(qb, kb, key_padding_mask=kpm, rows=rows, lln=lln)[0][:, :, tokens]  # (H, R, n)
    chain = tokens[:max_chain]
    if len(chain) == len(rows) and torch.equal(chain, rows):
        C = P[:, :, :len(chain)]
    else:
        C = module.attention_rows(qb, kb, key_padding_mask=kpm, rows=chain, lln=lln)[0][:, :, chain]
    chain_mass = C.sum(-1, keepdim=True)
    C = C / chain_mass.clamp_min(torch.finfo(C.dtype).tiny)
    markov = (chain_mass > 0).all(-2)[:, 0]  # (H,): a head whose chain has an empty row has no gap

    qt, kt = qb[0][:, tokens].double(), kb[0][:, tokens].double()
    out = {
        "entropy": entropy(P),
        "entropy_max": torch.log2((P > 0).sum(-1).double()).mean(-1),
        "spectral_gap": _gap(C, markov),
        "sparsity": sparsity(P),
        "temperature_softmax": softmax_temperature(qt, kt),
        "sigma_q": qt.flatten(1).std(1, unbiased=False),
        "sigma_k": kt.flatten(1).std(1, unbiased=False),
    }
    out["log_p_mean"], out["log_p_var"] = log_moments(P)
    out["log_p_rel_var"] = log_moments(P, relative=True)[1]
    if lln is not None:
        out.update(alpha=_spread(lln["alpha"], h), beta=_spread(lln["beta"], h),
                   temperature_lln=_spread(lln["tau"], h))
    if module.is_kernel_method:
        out["kernel_row_sum"] = module.kernel_rows(qb, kb, kpm, rows).sum(-1).mean(-1)[0]
    if compare:
        out.update(_comparison(qt, kt, torch.searchsorted(tokens, rows), module.causal, out["sigma_q"], out["sigma_k"]))
    out = {name: value.double().cpu() for name, value in out.items()}
    if log_p_samples > 0:
        positive = P > 0
        values = (P.clamp_min(torch.finfo(P.dtype).tiny).log() + positive.sum(-1, keepdim=True).log())[positive]
        pick = torch.randperm(values.numel(), generator=generator)[:log_p_samples]
        out["log_p_rel"] = values.double().cpu()[pick]
    return out
