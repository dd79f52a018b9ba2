"""One data-parallel rank of fairseq-train that leaves its process group before the interpreter ends.

fairseq 0.12 ends a distributed run with a barrier and returns without ``destroy_process_group``. The
gloo group's worker threads are then torn down during interpreter finalisation, and the process can
abort there (SIGABRT, "terminate called without an active exception"; pytorch/pytorch#190489): a
run that trained to the end exits 134 now and then. ``run`` destroys the group once training has
returned. After an exception it leaves the group alone: another rank may still wait in a collective,
and the launcher stops the ranks on the non-zero status.

    python -m linattn_tools.ddp_rank DATA ... (fairseq-train arguments; what ``cpu_ddp`` runs per rank)

A rank program of one's own (``cpu_ddp --train-command``) ends with ``run(cli_main)`` in the same way.
"""
import sys
from typing import Callable, Optional


def leave_process_group() -> None:
    """Destroy torch.distributed's default group, if one is up; a no-op otherwise."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def run(cli_main: Callable[[], Optional[int]]) -> Optional[int]:
    """``cli_main()``, then ``leave_process_group()`` if it returned; its result is returned."""
    result = cli_main()
    leave_process_group()
    return result


def main() -> Optional[int]:
    from fairseq_cli.train import cli_main  # first, as under fairseq-train: its logging set-up

    return run(cli_main)


if __name__ == "__main__":
    sys.exit(main())
