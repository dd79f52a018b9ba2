"""Linear Log-Normal attention (LLN, Nahshan et al., eq. 8-9): phi_q = exp(alpha q), phi_k = exp(beta k).

out_i = phi_q(q_i)^T sum_j phi_k(k_j) v_j^T / phi_q(q_i)^T sum_l phi_k(k_l)   (sums over j <= i if causal)

Stabilisation (every shift cancels exactly between numerator and denominator):
- keys are shifted per feature d by a max over keys the query may see (M_d), so that
  z_d = sum_j exp(beta k_jd - M_d) >= 1; the query absorbs exp(M_d) and is shifted by its own max;
- in causal mode M comes from *earlier chunks only*; a key of the current chunk that exceeds it
  carries its own scalar shift g_j >= 0, and each query row is referenced to the running max of g
  over the keys it sees. No output depends on a future token, even through rounding.
"""
from .autograd import lln_attention
from .decode import lln_decode_init, lln_decode_step
from .reference import lln_attention_reference, lln_attention_weights
