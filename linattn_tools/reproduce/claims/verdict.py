"""What every claim shares: the verdict a claim's test returns, the claim itself, and small helpers."""
from typing import Callable, Dict, NamedTuple, Optional

GiB = 2 ** 30


class Verdict(NamedTuple):
    paper: str                 # the paper's figure
    ours: str                  # ours
    holds: Optional[bool]      # None: no claim to test (information only)
    test: str                  # what "holds" means, in words
    cause: str = ""            # the likely cause, shown when holds is False
    note: str = ""             # setting differences, extrapolation


class Claim(NamedTuple):
    id: str
    paper: str                 # "LLN", "LAVO", "Skyformer"
    where: str                 # proposition, table, figure, section
    statement: str
    group: str                 # the result file it needs
    evaluate: Callable[[Dict], Verdict]


def pct(x: float) -> str:
    return f"{x * 100:+.0f} %"


def cores(rec: Dict) -> str:
    """"2-core" for a record measured on a machine with two CPU cores (from the record's machine block)."""
    count = (rec.get("machine") or {}).get("cpu_count")
    return f"{count}-core" if count else "multi-core"
