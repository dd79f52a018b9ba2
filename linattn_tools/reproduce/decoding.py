"""LAVO Table 10 (Appendix B): total time to generate L tokens one at a time.

A fairseq decoder generates greedily from one start token, one forward per token through
``model.decoder(prefix, incremental_state=state)`` as fairseq's sequence generator calls it: softmax
keeps every earlier key and value in its cache, LLN its running sums, LAVO its window and memory.
One run to the longest L gives the total time at every shorter L on the way (the first L steps of a
longer run are the same computation); the methods' models take one step each in turn, so that a
change in the machine's load falls on all of them alike. The model is built as ``fairseq-train`` builds it
(``benchmark.fairseq_models.build``) on a dummy dictionary; nothing is trained, since time does not
depend on the weights.

The default model is a 2-layer slice of the paper's GPT-2 backbone (``linattn_lm_gpt``: 768-d, 12
heads, FFN 3072, with ``--decoder-layers 2``) with a 8,376-word dictionary: 2/12 of GPT-2's 50,257
words, so the output projection keeps the same share of a token's cost as in the 12-layer model, and
every per-layer cost (attention included) keeps its share too. The speed-up of one attention over
another is then that of the full model, at a sixth of the time (the full model on this shared 2-core
machine takes hours for three methods at 8192 tokens). One thread: on a machine shared with other
jobs, two-thread runs wait for a descheduled thread at every small op of a decoding step. Both the
wall-clock time and the process's CPU time of the steps are kept; with one thread the CPU time is the
work of the steps without the time the process waited for a core, and the ledger uses it.
"""
import tempfile
import time
from pathlib import Path
from typing import Dict, Sequence

import torch

from ..benchmark import fairseq_models
from .common import settings, torch_threads

FULL_LAYERS = 12  # the paper's GPT-2 backbone: configs/reproduce.yaml's vocab is GPT2_VOCAB * 2 / FULL_LAYERS
DEFAULTS, QUICK = settings("decoding")


def _state_bytes(state: dict) -> int:
    return sum(t.numel() * t.element_size() for buf in state.values() if isinstance(buf, dict)
               for t in buf.values() if isinstance(t, torch.Tensor))


@torch.no_grad()
def generate(models: Dict[str, torch.nn.Module], bos: int, length: int, checkpoints: Sequence[int]) -> Dict[str, Dict]:
    """Greedy generation of ``length`` tokens by each model, one token of each in turn (so that every
    model sees the same machine load over time); per model the seconds spent in its own steps and its
    cache bytes after each checkpoint."""
    tokens = {m: torch.full((1, length + 1), bos, dtype=torch.long) for m in models}
    states: Dict[str, dict] = {m: {} for m in models}
    spent = {m: 0.0 for m in models}
    cpu = {m: 0.0 for m in models}
    out = {m: {"seconds": {}, "cpu_seconds": {}, "state_bytes": {}} for m in models}
    marks = set(checkpoints)
    for t in range(length):
        for m, model in models.items():
            t0, c0 = time.perf_counter(), time.process_time()
            logits, _ = model.decoder(tokens[m][:, :t + 1], incremental_state=states[m])
            tokens[m][0, t + 1] = logits[0, -1].argmax()
            spent[m] += time.perf_counter() - t0
            cpu[m] += time.process_time() - c0
            if t + 1 in marks:
                out[m]["seconds"][str(t + 1)] = spent[m]
                out[m]["cpu_seconds"][str(t + 1)] = cpu[m]
                out[m]["state_bytes"][str(t + 1)] = _state_bytes(states[m])
        if t + 1 in marks:
            print(f"[decoding] {t + 1} tokens: " + ", ".join(f"{m} {spent[m]:.1f} s (CPU {cpu[m]:.1f} s)"
                                                              for m in models), flush=True)
    return out


def measure(*, lengths: Sequence[int], methods: Sequence[str], arch: str, layers: int, vocab: int, threads: int,
            model_args: Sequence[str]) -> Dict:
    """{"runs": {method: {"seconds": {L: s}, "state_bytes": {L: bytes}}}, "parameters": {method: count}}."""
    with torch_threads(threads):
        return _measure(lengths, methods, arch, layers, vocab, model_args, max(lengths))


def _measure(lengths, methods, arch, layers, vocab, model_args, longest) -> Dict:
    models, parameters = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        data = fairseq_models.write_dictionary(Path(tmp), vocab - 4)
        for method in methods:
            built = fairseq_models.build(data, [
                "--task", "language_modeling", "--arch", arch, "--decoder-attention-type", method,
                "--tokens-per-sample", str(longest + 1), "--max-target-positions", str(longest + 1),
                "--decoder-layers", str(layers), "--seed", "1", "--cpu", *model_args], optimizer=False)
            models[method] = built["model"].eval()
            parameters[method] = sum(p.numel() for p in models[method].parameters())
            bos = built["task"].target_dictionary.eos()
    generate(models, bos, 8, [8])  # warm-up; every state starts afresh below
    runs = generate(models, bos, longest, lengths)
    return {"runs": runs, "parameters": parameters, "threads": torch.get_num_threads()}
