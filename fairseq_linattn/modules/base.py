"""The fairseq adapter shared by every method: ``AttentionBase``.

Each module owns ``q_proj``, ``k_proj``, ``v_proj``, ``out_proj`` (fairseq's names, so a softmax
checkpoint loads into any variant), reshapes fairseq's time-first (T, B, C) to the ops' (B, H, T, D),
calls its op, and keeps an O(1)-or-O(window) incremental state for decoding. Causality is fixed at
construction (decoder self-attention), never inferred from a mask. One subclass per method, in the
file named for it, registered under the method's name (``@register_attention``, ``registry.py``).
"""
import functools
import logging
import math
from typing import Dict, Optional, Tuple

import torch
from fairseq.incremental_decoding_utils import with_incremental_state
from torch import Tensor, nn
from torch.nn import functional as F

from linattn.config import AttentionConfig
from linattn.methods import METHODS, methods_for
from linattn.ops.impls import choose, table_of
from linattn.ops.packed_heads import pack_rows, split_heads

from . import compile_check, cuda_graph
from .registry import ATTENTION_CLASSES

State = Dict[str, Optional[Tensor]]
logger = logging.getLogger(__name__)
_SAID = set()  # the implementation choices logged (``_say_impl``): each once per process


@with_incremental_state
class AttentionBase(nn.Module):
    """Projections, layout and incremental-state plumbing shared by every method."""

    method = "base"  # its name in linattn.methods.METHODS, set on each subclass by @register_attention
    takes_attn_mask = False  # an arbitrary (T, S) attn_mask, beyond causality fixed at construction
    uses_keys = True  # False for a method whose output never reads the keys (LAVO cross-attention)
    caches_source = False  # True for a cross-attention that keeps only a summary of its source
    is_kernel_method = False  # True: ``attention_rows`` normalises the rows of a kernel C (out = C V), ``kernel_rows``

    def __init__(self, embed_dim: int, num_heads: int, *, config: Optional[AttentionConfig] = None,
                 kdim: Optional[int] = None, vdim: Optional[int] = None, dropout: float = 0.0, causal: bool = False,
                 cross: bool = False, bias: bool = True):
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        if causal and "decoder" not in METHODS[self.method].roles:
            raise ValueError(f"{self.method} is a non-causal method and cannot be causal (decoder) "
                             f"self-attention; causal methods: {', '.join(methods_for('decoder'))}")
        self.config = AttentionConfig() if config is None else config
        if self.config.attention_compile:
            compile_check.check_torch_for_compile()
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.head_dim = embed_dim // num_heads
        self.causal, self.cross = causal, cross
        self.dropout = dropout
        kdim, vdim = kdim or embed_dim, vdim or embed_dim
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.k_proj = nn.Linear(kdim, embed_dim, bias=bias)
        self.v_proj = nn.Linear(vdim, embed_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.packs_projections = kdim == vdim == embed_dim  # self-attention's q, k, v in one matmul (_packed_heads)
        # fairseq MultiheadAttention's initialisation
        gain = 1 / math.sqrt(2) if kdim == vdim == embed_dim else 1.0
        for proj in (self.q_proj, self.k_proj, self.v_proj):
            nn.init.xavier_uniform_(proj.weight, gain=gain)
        nn.init.xavier_uniform_(self.out_proj.weight)
        if bias:
            nn.init.constant_(self.out_proj.bias, 0.0)

    # -- layout ---------------------------------------------------------------------------------
    def _heads(self, x: Tensor) -> Tensor:
        """(T, B, C) -> (B, H, T, D)."""
        t, b, _ = x.shape
        return x.view(t, b, self.num_heads, -1).permute(1, 2, 0, 3)

    def forward(self, query: Tensor, key: Optional[Tensor], value: Optional[Tensor],
                key_padding_mask: Optional[Tensor] = None, incremental_state=None, need_weights: bool = True,
                static_kv: bool = False, attn_mask: Optional[Tensor] = None, before_softmax: bool = False,
                need_head_weights: bool = False) -> Tuple[Tensor, Optional[Tensor]]:
        """query (T, B, C), key/value (S, B, C) -> ((T, B, C), weights or None), as fairseq's MHA.

        Decoding (``incremental_state``): a causal module takes its tokens one at a time with a (B, T)
        or (B, 1) ``key_padding_mask`` for them (or None when they are all real, as fairseq's decoder
        passes it); a module that caches its source (``static_kv``) reads it once per source.
        """
        if before_softmax:
            raise ValueError(f"{self.method} attention has no pre-softmax scores (before_softmax=True)")
        key = query if key is None else key
        value = key if value is None else value
        t, b, _ = query.shape
        attn_mask = self._accepted_attn_mask(attn_mask, t, key.shape[0], incremental_state is not None)
        if incremental_state is None and key is query and value is query and self.packs_projections:
            if self.config.attention_cuda_graph and attn_mask is None and not (need_weights or need_head_weights):
                out = self._graphed_steps()(query, key_padding_mask)
                if out is not None:
                    return out, None
            return self._packed_attention(query, key_padding_mask, attn_mask, need_weights, need_head_weights)
        q = self._heads(self.q_proj(query))
        k = None
        if incremental_state is not None and static_kv and self.caches_source:
            state = self._get_input_buffer(incremental_state)
            if not state:  # first step of this source: read it once, keep what the method needs of it
                state = self.source_state(self._heads(self.v_proj(value)), key_padding_mask)
                self._set_input_buffer(incremental_state, state)
            out = self.attend_source(q, state)
        elif incremental_state is not None and self.causal:
            k, v = self._heads(self.k_proj(key)), self._heads(self.v_proj(value))
            state = self._get_input_buffer(incremental_state)
            outs = []
            for i in range(t):  # fairseq feeds one token per step; a longer prompt goes token by token
                kpm = None if key_padding_mask is None else key_padding_mask[:, -t + i:][:, :1]
                out_i, state = self.step(q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1], kpm, state)
                outs.append(out_i)
            self._set_input_buffer(incremental_state, state)
            out = torch.cat(outs, 2)
        else:
            k = self._heads(self.k_proj(key)) if self.uses_keys else None
            out = self._attend_call()(q, k, self._heads(self.v_proj(value)), key_padding_mask, attn_mask)
        if incremental_state is not None:  # no weights while decoding
            need_weights = need_head_weights = False
        return self._merged(q, k, out, key_padding_mask, attn_mask, need_weights, need_head_weights)

    def self_attention(self, x: Tensor, key_padding_mask: Optional[Tensor] = None) -> Tensor:
        """Self-attention's output (T, B, C) of x (T, B, C), no weights: the eager training forward, which
        ``--attention-cuda-graph`` captures (``cuda_graph.Step``)."""
        return self._packed_attention(x, key_padding_mask, None, False, False)[0]

    def _packed_attention(self, x: Tensor, key_padding_mask: Optional[Tensor], attn_mask: Optional[Tensor],
                          need_weights: bool, need_head_weights: bool) -> Tuple[Tensor, Optional[Tensor]]:
        """Self-attention of x (T, B, C) with q, k, v in one projection (``_packed_heads``): as ``forward``."""
        q, k, v = self._packed_heads(x)
        out = self._attend_call()(q, k if self.uses_keys else None, v, key_padding_mask, attn_mask)
        return self._merged(q, k, out, key_padding_mask, attn_mask, need_weights, need_head_weights)

    def _graphed_steps(self) -> cuda_graph.GraphedSteps:
        """The module's captured training steps (``--attention-cuda-graph``), kept out of its state."""
        steps = self.__dict__.get("_cuda_graphs")
        if steps is None:
            steps = self.__dict__["_cuda_graphs"] = cuda_graph.GraphedSteps(self)
        return steps

    def _apply(self, fn, *args, **kwargs):
        self.__dict__.pop("_cuda_graphs", None)  # a graph reads the very tensors it was captured with
        return super()._apply(fn, *args, **kwargs)

    def __getstate__(self):
        """A copy (``copy.deepcopy``: fairseq's EMA model, our checks) or pickle captures its own graphs: these read
        this module's tensors."""
        state = super().__getstate__()
        state.pop("_cuda_graphs", None)
        return state

    def train(self, mode: bool = True):
        """fairseq's trainer calls ``model.train()`` before every update attempt: a graphed step whose backward did
        not come (an attempt it skipped) no longer holds the next one eager (``cuda_graph``)."""
        steps = self.__dict__.get("_cuda_graphs")
        if steps is not None:
            steps.forget_pending()
        return super().train(mode)

    def _packed_heads(self, x: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """Self-attention's q, k, v (B, H, T, D) from x (T, B, C) in one matmul: views of a (T, B, H, 3, D) tensor,
        each head's q, k and v rows side by side (as Megatron-LM packs them), which the fused kernels read in place
        (head stride 3D) and whose gradients they write into one such tensor (``linattn.ops.packed_heads``: else
        stacked into one). The weights stay ``q_proj``, ``k_proj``, ``v_proj``."""
        h, d = self.num_heads, self.head_dim
        projs = (self.q_proj, self.k_proj, self.v_proj)
        weight = pack_rows(h, *(p.weight for p in projs))
        bias = None if self.q_proj.bias is None else pack_rows(h, *(p.bias for p in projs))
        t, b, _ = x.shape
        return split_heads(F.linear(x, weight, bias).view(t, b, h, 3, d))

    def _merged(self, q: Tensor, k: Optional[Tensor], out: Tensor, key_padding_mask: Optional[Tensor],
                attn_mask: Optional[Tensor], need_weights: bool, need_head_weights: bool
                ) -> Tuple[Tensor, Optional[Tensor]]:
        """The heads' outputs (B, H, T, D) merged and projected to (T, B, C), and the attention weights asked for."""
        b, _, t, _ = out.shape
        out = out.permute(2, 0, 1, 3).reshape(t, b, self.embed_dim)
        weights = None
        if need_weights or need_head_weights:
            weights = self.attention_weights(q, k, key_padding_mask, attn_mask)  # (B, H, T, S) if the method has them
            if weights is not None:  # fairseq's layout: (H, B, T, S) per head, else the mean over heads
                weights = weights.transpose(0, 1) if need_head_weights else weights.mean(1)
        return self.out_proj(out), weights

    @classmethod
    def impl_options(cls, config: AttentionConfig, params: torch.dtype) -> dict:
        """The options of ``config`` its op's implementations check besides q and v (``impls.unsupported_reasons``:
        LLN's chunk, LAVO's window and bases, ...), its parameters in ``params``; none here."""
        return {}

    def _say_impl(self) -> None:
        """Log once per module type (method and role) the implementation its op runs where it was chosen, not named
        (``--attention-impl auto``, or a name the method has no implementation of), and why (``impls.choose``)."""
        self.__dict__["_impl_said"] = True
        table = table_of(self.method)
        if table is None or self.cross:  # SDPA; the cross-attentions' read-outs: one implementation each
            return
        impl, why = choose(self.config.attention_impl, self.q_proj.weight.device, tuple(table),
                           compiling=self.config.attention_compile)
        message = (f"linattn: {self.method} {'decoder' if self.causal else 'encoder'} self-attention runs {impl!r} "
                   f"({why})")
        if why != "asked for" and message not in _SAID:
            _SAID.add(message)
            logger.info(message)

    def _attend_call(self):
        """``attend``, compiled once per module with ``--attention-compile`` (kept out of the module's state); its
        first training step checked against eager (``compile_check``) unless ``--attention-compile-check off``. The
        first call logs the implementation chosen (``_say_impl``)."""
        if not self.__dict__.get("_impl_said"):
            self._say_impl()
        if not self.config.attention_compile:
            return self.attend
        if "_compiled_attend" not in self.__dict__:
            self.__dict__["_compiled_attend"] = compile_check.compile_attend(self)
        compiled = self.__dict__["_compiled_attend"]
        if (self.config.attention_compile_check == "first-step" and self.training and torch.is_grad_enabled()
                and not self.__dict__.get("_compile_checked")):
            self.__dict__["_compile_checked"] = True
            return functools.partial(compile_check.check_first_step, self, compiled)
        return compiled

    def _accepted_attn_mask(self, attn_mask: Optional[Tensor], t: int, s: int, decoding: bool) -> Optional[Tensor]:
        """The attn_mask ``attend`` must apply: None when there is none or it is the future mask a causal
        module applies anyway (fairseq's ``buffered_future_mask``); any other mask is refused, never dropped."""
        if attn_mask is None:
            return None
        if self.causal and not decoding and is_future_mask(attn_mask, t, s):
            return None
        if self.takes_attn_mask and not decoding:
            return attn_mask
        takers = ", ".join(name for name, cls in ATTENTION_CLASSES.items() if cls.takes_attn_mask)
        takes = "the standard causal (future) mask only (none while decoding)" if self.causal else "no attn_mask"
        raise ValueError(
            f"{'causal ' if self.causal else ''}{self.method} attention takes {takes}; "
            f"got {'another' if self.causal else 'a'} {tuple(attn_mask.shape)} attn_mask"
            f"{' while decoding' if decoding else ''}. An arbitrary attn_mask is "
            f"taken by: {takers} (--encoder-attention-type / --decoder-attention-type)")

    def attend(self, q: Tensor, k: Optional[Tensor], v: Tensor, key_padding_mask: Optional[Tensor],
               attn_mask: Optional[Tensor] = None) -> Tensor:
        """Full-sequence attention on (B, H, N, D) tensors (``attn_mask`` only where ``takes_attn_mask``)."""
        raise NotImplementedError

    def source_state(self, v: Tensor, key_padding_mask: Optional[Tensor]) -> State:
        """What a source-caching cross-attention keeps of its source values (B, H, S, D) while decoding."""
        raise NotImplementedError

    def attend_source(self, q: Tensor, state: State) -> Tensor:
        """Cross-attention of queries (B, H, T, D) to the source kept by ``source_state``."""
        raise NotImplementedError

    def attention_weights(self, q: Tensor, k: Optional[Tensor], key_padding_mask: Optional[Tensor],
                          attn_mask: Optional[Tensor] = None) -> Optional[Tensor]:
        """The (B, H, T, S) attention matrix for ``need_weights``; None for methods that never form it
        (``attention_rows`` materialises theirs for analysis)."""
        return None

    def step(self, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor], state: State):
        """One decoding step: (B, H, 1, D) tensors and the buffered state -> (out, new state)."""
        raise NotImplementedError(f"{self.method} attention has no incremental decoding")

    # -- analysis: the module describes its own attention (docs/design.md §8) ----------------------
    def attention_rows(self, q: Tensor, k: Tensor, key_padding_mask: Optional[Tensor] = None, rows=None,
                       lln: Optional[Dict[str, Tensor]] = None) -> Tensor:
        """Rows of the module's row-stochastic attention matrix P (B, H, R, N) from its projected q, k (B, H, N, D).

        ``rows``: None (all), an int (that many evenly spaced rows) or a LongTensor of indices
        (``ops.select_rows``).
        ``lln``: LLN's alpha, beta (shape (G,)) for this forward, e.g. the matcher's ``last_alpha`` /
        ``last_beta`` of the forward being analysed (default: ``lln_parameters(q, k, key_padding_mask)``);
        modules other than LLN's ignore it.
        Float32 for half inputs; a query with no visible key gets a row of zeros. What P is: the subclass's
        docstring. No state of the module changes.
        """
        raise NotImplementedError(f"{self.method} attention has no attention rows")

    def reference(self, q: Tensor, k: Optional[Tensor], v: Tensor, key_padding_mask: Optional[Tensor] = None) -> Tensor:
        """What ``attend`` computes, materialised by the op's ``*_reference`` (the paper's formula, N×N), in the
        inputs' dtype: run it on a float64 copy of the module to check ``attend`` (tests, GPU self-test)."""
        raise NotImplementedError(f"{self.method} attention has no reference")

    def lln_parameters(self, q: Tensor, k: Tensor, key_padding_mask: Optional[Tensor] = None
                       ) -> Optional[Dict[str, Tensor]]:
        """alpha, beta, sigma_q, sigma_k, tau (shape (G,)) of an LLN module for q, k; None for other methods."""
        return None

    def kernel_rows(self, q: Tensor, k: Tensor, key_padding_mask: Optional[Tensor] = None, rows=None) -> Tensor:
        """Rows of a kernel method's unnormalised C (B, H, R, N), out = C V (where ``is_kernel_method``)."""
        raise NotImplementedError(f"{self.method} attention is not a kernel method")

    # -- loading a softmax checkpoint ("linearization": attention swap, then fine-tune) ----------
    def upgrade_state_dict_named(self, state_dict: dict, name: str) -> None:
        """Fill this method's own parameters/buffers missing from ``state_dict`` with their init values.

        A stock fairseq MultiheadAttention checkpoint has only q/k/v/out_proj: loading it into any of
        our methods (``--finetune-from-model``, ``--restore-file``) keeps those and starts LAVO's bases
        and bias, LLN+Diag's mix weights and LLN's EMA or running statistics fresh. fairseq calls this before its
        strict ``load_state_dict``.
        """
        prefix = name + "." if name else ""
        own = {key: value for key, value in self.state_dict(keep_vars=True).items()}  # persistent entries only
        if not any(key.startswith(prefix + "q_proj.") for key in state_dict):
            return  # this module is not in the checkpoint at all (e.g. a head added later)
        for key, value in own.items():
            if not key.split(".")[0].endswith("_proj") and prefix + key not in state_dict:
                logger.info("%s%s is not in the checkpoint: starting it from its initial value", prefix, key)
                state_dict[prefix + key] = value.detach().clone()

    # -- fairseq's incremental-state contract ---------------------------------------------------
    def _get_input_buffer(self, incremental_state) -> State:
        result = self.get_incremental_state(incremental_state, "attn_state")
        return result if result is not None else {}

    def _set_input_buffer(self, incremental_state, buffer: State):
        return self.set_incremental_state(incremental_state, "attn_state", buffer)

    def reorder_incremental_state(self, incremental_state, new_order: Tensor):
        """Beam search: every buffered tensor has the batch (times beam) on dim 0."""
        buffer = self._get_input_buffer(incremental_state)
        if buffer:
            buffer = {name: (t.index_select(0, new_order) if t is not None else None) for name, t in buffer.items()}
            incremental_state = self._set_input_buffer(incremental_state, buffer)
        return incremental_state


def is_future_mask(attn_mask: Tensor, t: int, s: int) -> bool:
    """True if ``attn_mask`` is fairseq's (T, T) future mask: -inf (or True) above the diagonal, 0 (False) on
    and below it. O(T²) like the mask itself; fairseq_linattn's own decoders pass none."""
    if tuple(attn_mask.shape) != (t, s) or t != s:
        return False
    future = torch.ones(t, t, dtype=torch.bool, device=attn_mask.device).triu(1)
    if attn_mask.dtype == torch.bool:
        return bool(torch.equal(attn_mask, future))  # sync ok: only for a passed attn_mask (our models pass none)
    if not attn_mask.is_floating_point():
        return False
    ok = torch.equal(torch.isneginf(attn_mask), future) and (attn_mask.masked_fill(future, 0) == 0).all()  # sync ok
    return bool(ok)  # sync ok: only for a passed attn_mask, as above
