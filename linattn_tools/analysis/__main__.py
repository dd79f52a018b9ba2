"""``python -m linattn_tools.analysis``: see ``cli.py``."""
import sys

from .cli import main

sys.exit(main())
