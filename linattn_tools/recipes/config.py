"""``configs/*.yaml`` -> fairseq-train options, with the update frequency that keeps the paper's batch.

A config has ``data``, ``batch`` ({unit: sequences|tokens, total, per_device}), ``train`` (fairseq
options: ``true`` is a bare flag, ``false``/``null`` drops it), ``fp16`` (options for fp16 on GPU),
optional ``tasks`` (per-task options) and ``eval``; its ``sample`` section overrides any of these
for the CPU runs on the shipped samples. The scripts call the command line:

    python -m linattn_tools.recipes.config args configs/glue.yaml --task mnli --devices 8 --device gpu
    python -m linattn_tools.recipes.config get configs/pg19_lm.yaml eval.contexts --sample

``args`` on the CPU (``--device cpu``) gives ``--cpu`` and leaves out the fp16 section (fairseq's fp16 needs a
GPU). Without ``--device`` the device is the recipe scripts' ``DEVICE`` (``cpu``, or anything else for the GPU)
when it is set, else the GPU when torch sees one and the CPU otherwise.

(It imports nothing of the package and no fairseq, and torch only to look for a GPU when neither ``--device`` nor
``DEVICE`` says the device, so the scripts' ``python -m`` calls start quickly.)
"""
import argparse
import math
import os
import sys
from pathlib import Path
from typing import Dict, List, Optional

import yaml

BATCH_UNITS = {"sequences": "--batch-size", "tokens": "--max-tokens"}
DEVICES = ("gpu", "cpu")


def default_device() -> str:
    """The device when ``--device`` is not given: ``DEVICE`` as the recipe scripts read it (``cpu``, else the GPU),
    or, unset, the GPU when torch sees a CUDA device and the CPU otherwise."""
    if os.environ.get("DEVICE"):
        return "cpu" if os.environ["DEVICE"] == "cpu" else "gpu"
    import torch  # only here: the scripts always name the device

    return "gpu" if torch.cuda.is_available() else "cpu"


def load(path, sample: bool = False) -> dict:
    """The config as a dict; with ``sample`` its ``sample`` section merged over it."""
    with open(path) as f:
        config = yaml.safe_load(f)
    overrides = config.pop("sample", {}) or {}
    return _merge(config, overrides) if sample else config


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        if key == "tasks":  # the sample replaces the task list rather than extending it
            out[key] = value
        elif isinstance(value, dict) and isinstance(base.get(key), dict):
            out[key] = _merge(base[key], value)
        else:
            out[key] = value
    return out


def batch_split(batch: dict, devices: int, per_device: Optional[int] = None,
                update_freq: Optional[int] = None, granule: int = 1) -> Dict[str, int]:
    """Per-device batch and update frequency whose product with ``devices`` is the paper's total.

    The batch is split in whole granules: sequences, or for a token batch samples of ``granule``
    (= tokens-per-sample) tokens, since fairseq fills ``--max-tokens`` with whole samples. The
    per-device batch is at most the config's ``per_device`` (memory). The exact total with the fewest
    accumulation steps wins; without one, the fewest steps within 1 % of the total; where the devices
    cannot come that close (GLUE's 32 on 3 GPUs, PG-19's 16 samples on 24 GPUs) the closest batch.
    An explicit ``per_device`` or ``update_freq`` is kept as given and the other one computed.
    """
    unit, total = batch["unit"], int(batch["total"])
    if unit not in BATCH_UNITS:
        raise ValueError(f"batch.unit must be one of {', '.join(BATCH_UNITS)}, got {unit!r}")
    if devices < 1:
        raise ValueError(f"devices must be >= 1, got {devices}")
    if granule < 1 or total % granule:
        raise ValueError(f"batch.total ({total}) must be a multiple of the tokens per sample ({granule})")
    samples = total // granule
    cap = max(1, int(per_device or batch["per_device"]) // granule)
    if per_device is not None or update_freq is not None:
        per = cap
        freq = int(update_freq or math.ceil(samples / (per * devices)))
    else:
        splits = []  # (distance from the total, update_freq, per_device)
        for freq in range(1, math.ceil(samples / devices) + 1):
            exact = samples / (devices * freq)
            for per in {min(cap, max(1, math.floor(exact))), min(cap, math.ceil(exact))}:
                splits.append((abs(per * devices * freq - samples), freq, per))
        closest = min(s[0] for s in splits)
        tolerance = 0 if closest == 0 else max(closest, samples // 100)
        _, freq, per = min((s for s in splits if s[0] <= tolerance), key=lambda s: (s[1], -s[2]))
    return {"per_device": per * granule, "update_freq": freq, "effective": per * devices * freq * granule}


def task_names(config: dict) -> List[str]:
    return list((config.get("tasks") or {}).keys())


def train_options(config: dict, task: Optional[str] = None, fp16: bool = True, device: str = "gpu") -> dict:
    """The fairseq options: train, then fp16 (if used: never on the CPU), then the task's; ``--cpu`` on the CPU."""
    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    options = dict(config.get("train") or {})
    if device == "cpu":
        options["cpu"] = True
    elif fp16:
        options.update(config.get("fp16") or {})
    if task is not None:
        tasks = config.get("tasks") or {}
        if task not in tasks:
            raise ValueError(f"task must be one of {', '.join(tasks)}, got {task!r}")
        options.update(tasks[task])
    return options


def granule(config: dict, task: Optional[str] = None) -> int:
    """The unit a batch is made of: 1 sequence, or the tokens of one sample for a token batch."""
    if config["batch"]["unit"] != "tokens":
        return 1
    return int(train_options(config, task, fp16=False)["tokens-per-sample"])


def to_argv(options: dict) -> List[str]:
    """{'lr': 1e-5, 'fp16': True, 'x': None} -> ['--lr', '1e-05', '--fp16']."""
    argv = []
    for key, value in options.items():
        if value is None or value is False:
            continue
        argv.append(f"--{key}")
        if value is not True:
            argv.append(",".join(map(str, value)) if isinstance(value, list) else str(value))
    return argv


def fairseq_args(config: dict, devices: int, task: Optional[str] = None, fp16: bool = True,
                 per_device: Optional[int] = None, update_freq: Optional[int] = None,
                 split: Optional[Dict[str, int]] = None, device: str = "gpu") -> List[str]:
    """Everything the config says for ``device`` (``train_options``), plus the per-device batch and --update-freq
    (of ``split`` if given)."""
    split = split or batch_split(config["batch"], devices, per_device, update_freq, granule(config, task))
    batch_flag = BATCH_UNITS[config["batch"]["unit"]]
    return to_argv(train_options(config, task, fp16, device)) + [batch_flag, str(split["per_device"]),
                                                                 "--update-freq", str(split["update_freq"])]


def get(config: dict, dotted: str):
    value = config
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(f"{dotted}: not in the config")
        value = value[part]
    return value


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m linattn_tools.recipes.config", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    args_cmd = sub.add_parser("args", help="fairseq-train options, one per line")
    get_cmd = sub.add_parser("get", help="a value (lists and the keys of a mapping space-separated)")
    for cmd in (args_cmd, get_cmd):
        cmd.add_argument("config", type=Path)
        cmd.add_argument("--sample", action="store_true", help="merge the config's sample section")
    get_cmd.add_argument("key", help="dotted key, e.g. eval.contexts")
    args_cmd.add_argument("--task", help="a key of the config's tasks")
    args_cmd.add_argument("--devices", type=int, default=1, help="GPUs per node x nodes (default 1)")
    args_cmd.add_argument("--device", choices=DEVICES,
                          help="where fairseq-train runs: cpu gives --cpu and no fp16 options (default: $DEVICE "
                               "if set, else gpu when torch sees one, else cpu)")
    args_cmd.add_argument("--no-fp16", action="store_true", help="leave out the fp16 section (FP16=0)")
    args_cmd.add_argument("--per-device", type=int, help="override the per-device batch")
    args_cmd.add_argument("--update-freq", type=int, help="override the computed update frequency")
    args = parser.parse_args(argv)
    config = load(args.config, args.sample)
    if args.command == "get":
        value = get(config, args.key)
        print(" ".join(map(str, value)) if isinstance(value, (list, dict)) else value)
    else:
        split = batch_split(config["batch"], args.devices, args.per_device, args.update_freq,
                            granule(config, args.task))
        if split["effective"] != config["batch"]["total"]:
            print(f"[config] note: {args.devices} device(s) x {split['per_device']} x update-freq "
                  f"{split['update_freq']} = {split['effective']} {config['batch']['unit']} per update, "
                  f"not the paper's {config['batch']['total']}", file=sys.stderr)
        device = args.device or default_device()
        print("\n".join(fairseq_args(config, args.devices, args.task, not args.no_fp16, split=split, device=device)))


if __name__ == "__main__":
    main()
