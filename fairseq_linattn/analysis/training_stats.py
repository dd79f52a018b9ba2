"""Training-time concentration logging (``--attention-stats-interval K``, docs/design.md §7).

``install_attention_stats(model, K)`` adds a parameter-free submodule, ``AttentionStatsRecorder``,
and a forward hook on every plugin self-attention module. fairseq's ``FairseqTask.train_step`` calls
``model.set_num_updates(n)`` before each training forward, which reaches every submodule with that
method: on updates with n % K == 0 the hooks measure the first sequence of the batch (entropy over
``rows`` sampled query rows, spectral gap on the chain of its first ``chain_tokens`` tokens; see
``layer_stats``), so the cost per recorded layer is O(rows N D + chain_tokens² D + chain_tokens³)
whatever the batch. Other forwards (other updates, validation, incremental decoding) only test a flag.

``collect_attention_stats(model)`` returns what the last forward recorded, once, as
``{"attn_<layer>_<measure>": value}`` with layer labels ``enc0``, ``dec1``, ... and measures
``entropy``, ``spectral_gap`` (head means) and, for LLN layers, ``alpha``, ``beta``, ``tau`` (eq. 11):
``metrics_hook`` sums them over workers and logs them to TensorBoard.
"""
import functools
import re
from typing import Dict, Optional

import torch
from torch import nn

from .layer_stats import lln_forward_parameters, sequence_statistics
from .module_matrix import projected_qk

RECORDER_NAME = "linattn_attention_stats"


def self_attention_modules(model):
    """(name, module) of the plugin's self-attention modules in ``model`` (LAVO cross-attention excluded)."""
    from ..modules import AttentionBase

    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, AttentionBase) and not getattr(m, "cross", False)]


def layer_label(name: str, fallback: int) -> str:
    """'decoder.layers.3.self_attn' -> 'dec3', 'encoder.sentence_encoder.layers.0.self_attn' -> 'enc0'."""
    match = re.search(r"(encoder|decoder)\b.*?\blayers\.(\d+)\b", name)
    return f"{match.group(1)[:3]}{match.group(2)}" if match else f"layer{fallback}"


def call_arguments(args, kwargs):
    """query and key_padding_mask of a MultiheadAttention-style call (keyword or positional)."""
    query = kwargs["query"] if "query" in kwargs else args[0]
    mask = kwargs["key_padding_mask"] if "key_padding_mask" in kwargs else (args[3] if len(args) > 3 else None)
    incremental = kwargs.get("incremental_state", args[4] if len(args) > 4 else None)
    return query, mask, incremental


class AttentionStatsRecorder(nn.Module):
    """Parameter-free submodule holding the hooks' schedule and their latest measurements."""

    def __init__(self, interval: int, *, rows: int = 32, chain_tokens: int = 64):
        super().__init__()
        for name, value in (("interval", interval), ("rows", rows), ("chain_tokens", chain_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.interval, self.rows, self.chain_tokens = interval, rows, chain_tokens
        self.armed = False
        self._latest: Dict[str, torch.Tensor] = {}
        self._handles = []

    def extra_repr(self) -> str:
        return f"interval={self.interval}, rows={self.rows}, chain_tokens={self.chain_tokens}"

    def set_num_updates(self, num_updates: int) -> None:
        """Called by fairseq (``BaseFairseqModel.set_num_updates``) before every training forward."""
        self.armed = num_updates % self.interval == 0

    def attach(self, label: str, module: nn.Module) -> None:
        self._handles.append(module.register_forward_hook(functools.partial(self._record, label), with_kwargs=True))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _record(self, label, module, args, kwargs, output) -> None:
        if not (self.armed and module.training):
            return
        query, mask, incremental = call_arguments(args, kwargs)
        if incremental is not None:
            return
        with torch.no_grad():
            q, k = projected_qk(module, query.detach())
            stats = sequence_statistics(module, q, k, mask, 0, max_rows=self.rows, max_chain=self.chain_tokens,
                                        lln=lln_forward_parameters(module))
        self._latest[f"attn_{label}_entropy"] = stats["entropy"].mean()
        self._latest[f"attn_{label}_spectral_gap"] = stats["spectral_gap"].mean()
        if "alpha" in stats:
            for name, key in (("alpha", "alpha"), ("beta", "beta"), ("tau", "temperature_lln")):
                self._latest[f"attn_{label}_{name}"] = stats[key].mean()

    def collect(self) -> Dict[str, float]:
        """The latest measurements (once: the next call returns {} until the hooks record again)."""
        latest, self._latest = self._latest, {}
        if not latest:
            return {}
        return dict(zip(latest, torch.stack(list(latest.values())).tolist()))  # one device sync


def install_attention_stats(model: nn.Module, interval: int, *, rows: int = 32,
                            chain_tokens: int = 64) -> Optional[AttentionStatsRecorder]:
    """Record concentration statistics every ``interval`` updates (0 = off: returns None, adds nothing).

    Call once on a freshly built model (the models' ``build_model`` does, with
    ``args.attention_stats_interval``). The recorder is the submodule ``linattn_attention_stats``; it
    has no parameters or buffers, so checkpoints are unchanged.
    """
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 0:
        raise ValueError(f"--attention-stats-interval must be an integer >= 0, got {interval!r}")
    if interval == 0:
        return None
    if hasattr(model, RECORDER_NAME):
        raise ValueError("attention statistics are already installed on this model")
    recorder = AttentionStatsRecorder(interval, rows=rows, chain_tokens=chain_tokens)
    for i, (name, module) in enumerate(self_attention_modules(model)):
        recorder.attach(layer_label(name, i), module)
    setattr(model, RECORDER_NAME, recorder)
    return recorder


def collect_attention_stats(model: nn.Module) -> Dict[str, float]:
    """What the model's recorder measured in the last training forward, once; {} when nothing is new."""
    for module in model.modules():
        if isinstance(module, AttentionStatsRecorder):
            return module.collect()
    return {}
