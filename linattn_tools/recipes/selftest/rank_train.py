"""fairseq-train in which every rank writes its own checkpoint: rank 0 as usual, rank R > 0 beside it with the
suffix ``-rankR`` (``checkpoint_last-rank1.pt``); fairseq itself writes rank 0's only. The ``multi_gpu`` stage of the
self-test runs it as each rank's program to compare the ranks' moment statistics:

    python -m linattn_tools.recipes.selftest.rank_train DATA ... (fairseq-train arguments)
"""
import sys

from fairseq_cli.train import cli_main  # first, as under fairseq-train: its logging set-up

from linattn_tools.ddp_rank import run


def every_rank_saves() -> None:
    """Idempotent: every rank saves, under its own file names."""
    from fairseq.trainer import Trainer

    def suffix(self) -> str:
        rank = self.data_parallel_rank
        return (self.cfg.checkpoint.checkpoint_suffix or "") + ("" if rank == 0 else f"-rank{rank}")

    Trainer.should_save_checkpoint_on_current_rank = property(lambda self: True)
    Trainer.checkpoint_suffix = property(suffix)


if __name__ == "__main__":
    every_rank_saves()
    sys.exit(run(cli_main))
