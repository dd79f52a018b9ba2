"""``python -m fairseq_linattn.analysis``: see ``cli.py``."""
import sys

from .cli import main

sys.exit(main())
