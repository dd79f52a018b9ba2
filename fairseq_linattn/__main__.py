"""``python -m fairseq_linattn --user-dir``: the plugin's directory, the path fairseq's ``--user-dir`` needs.

fairseq takes ``--user-dir`` as a path (a bare ``fairseq_linattn`` resolves against the current directory only), so
a command run from anywhere says ``--user-dir "$(python -m fairseq_linattn --user-dir)"``.
"""
import argparse
import os
import sys
from typing import Optional, Sequence


def user_dir() -> str:
    """The absolute path of this package's directory."""
    return os.path.dirname(os.path.abspath(__file__))


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fairseq_linattn",
                                description="Print what a fairseq command line needs to load the plugin.")
    p.add_argument("--user-dir", action="store_true",
                   help="print the plugin's directory, for fairseq's --user-dir (from any directory)")
    args = p.parse_args(argv)
    if not args.user_dir:
        p.print_help(sys.stderr)
        return 2
    print(user_dir())
    return 0


if __name__ == "__main__":
    sys.exit(main())
