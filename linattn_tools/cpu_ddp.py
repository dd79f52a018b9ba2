"""Run fairseq's own data-parallel training on CPU processes of this machine (gloo).

fairseq 0.12 cannot start DDP on a CPU by itself: ``--distributed-world-size N --cpu`` spawns
``min(cuda devices, N)`` = 0 workers and exits without training, and under ``torchrun`` it computes
``rank % torch.cuda.device_count()`` (a division by zero) and wraps the model in a DDP with CUDA
``device_ids``. What works is fairseq's explicit form, one process per rank:
``--distributed-init-method tcp://HOST:PORT --distributed-world-size N --distributed-rank R
--distributed-no-spawn --distributed-backend gloo --ddp-backend legacy_ddp --cpu``. This launcher
starts the N processes with those flags (a free loopback port), each running fairseq-train's
``cli_main`` through ``linattn_tools.ddp_rank`` (which leaves the gloo group before the interpreter
ends), and polls them: when a rank exits
non-zero or is killed by a signal, the other ranks are stopped (SIGTERM, then SIGKILL after a grace
period) and the launcher exits non-zero (the rank's status, 128 + N for signal N) with a line on
stderr naming the rank; Ctrl-C stops every rank.

    python -m linattn_tools.cpu_ddp --nproc 2 -- DATA --task ... (any fairseq-train arguments)

The ranks run with glibc keeping freed memory (``linattn_tools/malloc.py``; an environment that sets
``MALLOC_MMAP_THRESHOLD_`` or ``MALLOC_TRIM_THRESHOLD_`` keeps its own). Each rank reads its own shard
of every batch, as under GPU DDP; the global batch is nproc × --batch-size × --update-freq. On GPUs use
fairseq's own launch (``--distributed-world-size`` or ``torchrun ... fairseq-train``): this module is for CPU
tests and CPU-only machines.
"""
import argparse
import importlib.util
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import List, Optional, Sequence

from .malloc import keeping_freed_memory


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_command(train_args: List[str], rank: int, nproc: int, port: int, executable) -> List[str]:
    """The command line of rank ``rank``; ``executable`` is a path or a list (a program and its arguments)."""
    program = [executable] if isinstance(executable, str) else list(executable)
    return [*program, *train_args, "--cpu", "--distributed-backend", "gloo", "--ddp-backend", "legacy_ddp",
            "--distributed-init-method", f"tcp://127.0.0.1:{port}", "--distributed-world-size", str(nproc),
            "--distributed-rank", str(rank), "--distributed-no-spawn"]


def exit_status(returncode: int) -> int:
    """A child's return code as a shell would report it: -N (killed by signal N) -> 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def describe(rank: int, returncode: int) -> str:
    """'rank 1 was killed by SIGKILL (signal 9)' or 'rank 1 exited with status 3'."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"rank {rank} was killed by {name} (signal {-returncode})"
    return f"rank {rank} exited with status {returncode}"


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Send ``sig`` to the process group of ``proc`` (a rank and, e.g., its data-loader workers)."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop(procs: Sequence[subprocess.Popen], grace: float = 5.0) -> None:
    """SIGTERM every rank still running (with its process group), SIGKILL those left after ``grace`` s."""
    running = [p for p in procs if p.poll() is None]
    for p in running:
        _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in running:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(p, signal.SIGKILL)
            p.wait()


class _Terminated(Exception):
    """SIGTERM to the launcher, raised in its main thread."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def wait_ranks(procs: Sequence[subprocess.Popen], *, grace: float = 5.0, poll_interval: float = 0.05,
               log=sys.stderr) -> int:
    """Poll the ranks until all exit 0 (-> 0) or one fails: then stop the others and return its status.

    A rank that exits with N != 0 gives N, one killed by signal N gives 128 + N (a line on ``log``
    names the rank). Ctrl-C (SIGINT) or SIGTERM to the launcher stops every rank and gives 128 + signal.
    Polling, not waiting in rank order: rank 0 may hang in a collective while rank 1 has died.
    """
    previous = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum, frame):
        raise _Terminated(signum)

    in_main_thread = threading.current_thread() is threading.main_thread()
    if in_main_thread:
        signal.signal(signal.SIGTERM, on_sigterm)
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                rank, code = failed[0]
                print(f"cpu_ddp: {describe(rank, code)}; stopping the other ranks", file=log, flush=True)
                stop(procs, grace)
                return exit_status(code)
            if all(c == 0 for c in codes):
                return 0
            time.sleep(poll_interval)
    except (KeyboardInterrupt, _Terminated) as err:
        signum = err.signum if isinstance(err, _Terminated) else signal.SIGINT
        print(f"cpu_ddp: interrupted ({signal.Signals(signum).name}); stopping the ranks", file=log, flush=True)
        stop(procs, grace)
        return 128 + signum
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous)


def launch(commands: Sequence[Sequence[str]], env: Optional[dict] = None, *, grace: float = 5.0) -> int:
    """Start one process per command (each in its own process group) and ``wait_ranks`` them."""
    procs = []
    try:
        for cmd in commands:
            procs.append(subprocess.Popen(list(cmd), env=env, start_new_session=True))
    except BaseException:
        stop(procs, grace)
        raise
    return wait_ranks(procs, grace=grace)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2, help="number of CPU worker processes (ranks)")
    parser.add_argument("--threads", type=int, default=1, help="OMP/MKL threads per rank")
    parser.add_argument("--grace", type=float, default=5.0,
                        help="seconds the other ranks get to exit after SIGTERM before SIGKILL (default 5)")
    parser.add_argument("--train-command", default=None,
                        help="program run per rank instead of fairseq-train (python -m linattn_tools.ddp_rank), "
                             "split like a shell line, e.g. 'python my_train.py'; it gets the same arguments")
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="-- followed by fairseq-train arguments")
    args = parser.parse_args(argv)
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    if args.nproc < 1:
        parser.error(f"--nproc must be >= 1, got {args.nproc}")
    if not args.grace >= 0:
        parser.error(f"--grace must be >= 0, got {args.grace}")
    if not train_args:
        parser.error("give the fairseq-train arguments after --")
    if args.train_command is not None:
        executable = shlex.split(args.train_command)
        if not executable:
            parser.error("--train-command is empty")
    else:
        if importlib.util.find_spec("fairseq_cli") is None:
            parser.error(f"fairseq is not installed for {sys.executable} (fairseq_cli is not importable)")
        executable = [sys.executable, "-m", "linattn_tools.ddp_rank"]
    env = keeping_freed_memory({**os.environ, "OMP_NUM_THREADS": str(args.threads),
                                "MKL_NUM_THREADS": str(args.threads)})
    port = free_port()
    commands = [rank_command(train_args, r, args.nproc, port, executable) for r in range(args.nproc)]
    return launch(commands, env, grace=args.grace)


if __name__ == "__main__":
    sys.exit(main())
