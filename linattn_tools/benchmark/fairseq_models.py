"""Plugin models built in-process the way ``fairseq-train`` builds them, on a dummy dictionary.

``build`` parses a fairseq command line (``--user-dir``, ``--task``, ``--arch`` and the plugin's
options), then runs ``tasks.setup_task``, ``task.build_model``, ``task.build_criterion`` and
``optim.build_optimizer``, as fairseq_cli/train.py does; no data is loaded (the task only reads
``dict.txt`` from the data directory).
"""
from pathlib import Path
from typing import Dict, List, Optional

import torch

USER_DIR = str(Path(__file__).resolve().parents[2] / "fairseq_linattn")
ROBERTA_VOCAB = 50265  # RoBERTa's GPT-2 BPE dictionary with fairseq's 4 specials and <mask>
GPT2_VOCAB = 50257


def write_dictionary(directory: Path, size: int) -> Path:
    """A ``dict.txt`` of ``size`` dummy symbols (fairseq adds its 4 specials to them)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "dict.txt").write_text("".join(f"w{i} {size - i}\n" for i in range(size)))
    return directory


def build(data_dir: Path, argv: List[str], *, optimizer: bool = True) -> Dict[str, object]:
    """{"cfg", "task", "model", "criterion", "optimizer"} for a fairseq training command line."""
    from fairseq import optim, options, tasks, utils
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, [str(data_dir), "--user-dir", USER_DIR, *argv])
    cfg = convert_namespace_to_omegaconf(args)
    utils.import_user_module(cfg.common)
    task = tasks.setup_task(cfg.task)
    model = task.build_model(cfg.model)
    criterion = task.build_criterion(cfg.criterion)
    opt = optim.build_optimizer(cfg.optimizer, [p for p in model.parameters() if p.requires_grad]) \
        if optimizer else None
    return {"cfg": cfg, "task": task, "model": model, "criterion": criterion, "optimizer": opt}


def masked_lm_sample(task, length: int, batch: int = 1, mask_prob: float = 0.15,
                     generator: Optional[torch.Generator] = None) -> dict:
    """A masked-LM batch as fairseq's MaskTokensDataset makes it: bos + tokens + eos, ``mask_prob`` of
    the tokens replaced by <mask>; the target holds the original tokens there and padding elsewhere."""
    d = task.source_dictionary
    tokens = torch.randint(d.nspecial, len(d) - 1, (batch, length), generator=generator)
    tokens[:, 0], tokens[:, -1] = d.bos(), d.eos()
    masked = torch.rand(batch, length, generator=generator) < mask_prob
    masked[:, 0] = masked[:, -1] = False
    masked[:, 1] = True  # at least one masked token
    target = torch.full_like(tokens, d.pad())
    target[masked] = tokens[masked]
    src = tokens.masked_fill(masked, task.mask_idx)
    return {"net_input": {"src_tokens": src, "src_lengths": torch.full((batch,), length)},
            "target": target, "ntokens": int(masked.sum()), "nsentences": batch}


def training_step(model, criterion, optimizer, sample) -> float:
    """One fairseq update without the Trainer's bookkeeping: zero grads, loss, backward, step."""
    model.train()
    optimizer.zero_grad()
    loss, sample_size, _ = criterion(model, sample)
    optimizer.backward(loss)
    optimizer.multiply_grads(1.0 / float(sample_size))  # fairseq normalises the summed loss this way
    optimizer.step()
    return float(loss.detach())


def state_bytes(model, optimizer) -> int:
    """Bytes of the parameters and the optimizer state (present before and after every step)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for state in optimizer.optimizer.state.values():
        total += sum(t.numel() * t.element_size() for t in state.values() if isinstance(t, torch.Tensor))
    return total
