"""Run fairseq's own data-parallel training on CPU processes of this machine (gloo).

fairseq 0.12 cannot start DDP on a CPU by itself: ``--distributed-world-size N --cpu`` spawns
``min(cuda devices, N)`` = 0 workers and exits without training, and under ``torchrun`` it computes
``rank % torch.cuda.device_count()`` (a division by zero) and wraps the model in a DDP with CUDA
``device_ids``. What works is fairseq's explicit form, one process per rank:
``--distributed-init-method tcp://HOST:PORT --distributed-world-size N --distributed-rank R
--distributed-no-spawn --distributed-backend gloo --ddp-backend legacy_ddp --cpu``. This launcher
starts the N processes with those flags (a free loopback port) and waits for them.

    python -m fairseq_linattn.cpu_ddp --nproc 2 -- DATA --task ... (any fairseq-train arguments)

Each rank reads its own shard of every batch, as under GPU DDP; the global batch is
nproc × --batch-size × --update-freq. On GPUs use fairseq's own launch (``--distributed-world-size``
or ``torchrun ... fairseq-train``): this module is for CPU tests and CPU-only machines.
"""
import argparse
import os
import shutil
import socket
import subprocess
import sys
from typing import List


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_command(train_args: List[str], rank: int, nproc: int, port: int, executable: str) -> List[str]:
    return [executable, *train_args, "--cpu", "--distributed-backend", "gloo", "--ddp-backend", "legacy_ddp",
            "--distributed-init-method", f"tcp://127.0.0.1:{port}", "--distributed-world-size", str(nproc),
            "--distributed-rank", str(rank), "--distributed-no-spawn"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2, help="number of CPU worker processes (ranks)")
    parser.add_argument("--threads", type=int, default=1, help="OMP/MKL threads per rank")
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="-- followed by fairseq-train arguments")
    args = parser.parse_args(argv)
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    if args.nproc < 1:
        parser.error(f"--nproc must be >= 1, got {args.nproc}")
    if not train_args:
        parser.error("give the fairseq-train arguments after --")
    executable = shutil.which("fairseq-train", path=os.path.dirname(sys.executable)) or shutil.which("fairseq-train")
    if executable is None:
        parser.error("fairseq-train is not on PATH (is fairseq installed in this environment?)")
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    port = free_port()
    procs = [subprocess.Popen(rank_command(train_args, r, args.nproc, port, executable), env=env)
             for r in range(args.nproc)]
    codes = [p.wait() for p in procs]
    return max(codes)


if __name__ == "__main__":
    sys.exit(main())
