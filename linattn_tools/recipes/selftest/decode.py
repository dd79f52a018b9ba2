"""The ``decode`` stage: fairseq's incremental decoding of the train stage's causal LMs equals their full forward on
the device (float32), for a padded batch (left, right and inner padding) and after a beam reordering, as
tests/plugin/test_fairseq_decoding.py checks on the CPU.

The sequences are long enough to cross two chunks, blocks and windows of the trained model. Token positions are left
out (the trained weights are loaded into the same model without them): fairseq numbers a left-padded row's positions
differently in the two modes, for any attention (docs/decoding.md), which is not what this stage checks.
"""
from linattn.tolerances import tolerance

from .core import Settings, Stage
from .ops import rel_err
from .training import lm_checkpoints

LENGTH_OPTIONS = ("lln_chunk_size", "lln_diag_block_size", "lavo_window")


def load_lm(path, device: str):
    """(task, model) of a checkpoint without token positions, in eval mode on ``device``."""
    from fairseq import checkpoint_utils, tasks

    import fairseq_linattn  # noqa: F401  (registers the models; fairseq's checkpoints load on today's torch)

    state = checkpoint_utils.load_checkpoint_to_cpu(str(path))
    cfg = state["cfg"]
    cfg.model.no_token_positional_embeddings = True
    task = tasks.setup_task(cfg.task)
    model = task.build_model(cfg.model)
    missing, unexpected = model.load_state_dict(state["model"], strict=False)
    leftover = [k for k in missing + unexpected if "embed_positions" not in k]
    if leftover:
        raise ValueError(f"the checkpoint does not fit the model without positions: {leftover[:5]}")
    return task, cfg, model.to(device).eval()


def padded_tokens(dictionary, gen, batch: int, t: int):
    """Row 0 left-padded, row 1 right-padded, row 2 padded on both sides and in the middle."""
    import torch

    tokens = torch.randint(dictionary.nspecial, len(dictionary), (batch, t), generator=gen)
    tokens[0, : t // 2] = dictionary.pad()
    tokens[1, t - t // 3:] = dictionary.pad()
    tokens[2, :2] = tokens[2, t // 2] = tokens[2, -1] = dictionary.pad()
    return tokens


def decode(decoder, tokens, order=None, switch_at: int = 0):
    """fairseq's incremental loop (the decoder reads only the last column); beams reordered at ``switch_at``.
    Returns the outputs (B, T - switch_at, V) from the switch on."""
    import torch

    state, outs = {}, []
    for t in range(tokens.shape[1]):
        if t == switch_at and order is not None:
            decoder.reorder_incremental_state_scripting(state, order)
            tokens, outs = tokens[order], []
        outs.append(decoder(tokens[:, : t + 1], incremental_state=state)[0])
    return torch.cat(outs, 1)


def check_lm(stage: Stage, spec: str, path, settings: Settings) -> None:
    import torch

    task, cfg, model = load_lm(path, settings.device)
    pad = task.target_dictionary.pad()
    t = 2 * max(int(getattr(cfg.model, name, 0) or 0) for name in LENGTH_OPTIONS) + 17
    tol = max(tolerance(m, "float32") for m in spec.split(","))
    gen = torch.Generator().manual_seed(0)
    tokens = padded_tokens(task.target_dictionary, gen, 3, t).to(settings.device)
    order, switch = torch.tensor([2, 0, 1, 2, 1], device=settings.device), t // 2 + 1
    with torch.no_grad():
        full = model.decoder(tokens)[0]
        inc = decode(model.decoder, tokens)
        real = tokens.ne(pad)
        err = rel_err(inc[real], full[real])
        stage.judge(f"lm {spec} padded batch, {t} tokens", err <= tol, err, f"<= {tol:.0e}",
                    "incremental vs full forward on the real tokens")
        full_beams = model.decoder(tokens[order])[0][:, switch:]
        inc_beams = decode(model.decoder, tokens, order, switch)
        real = tokens[order][:, switch:].ne(pad)
        err = rel_err(inc_beams[real], full_beams[real])
        stage.judge(f"lm {spec} beams reordered at step {switch}", err <= tol, err, f"<= {tol:.0e}",
                    "rows reordered and duplicated as beam search does")


def decode_stage(settings: Settings) -> Stage:
    stage = Stage("decode", note="float32 on the device; the train stage's causal LMs without token positions")
    for spec, path in lm_checkpoints(settings).items():
        if path is None:
            stage.judge(f"lm {spec}", False, "no checkpoint", "the train stage's checkpoint_last.pt")
            continue
        try:
            check_lm(stage, spec, path, settings)
        except Exception as exc:
            stage.add(f"lm {spec}", "FAIL", detail=f"{type(exc).__name__}: {exc}".splitlines()[0][:300])
    return stage

