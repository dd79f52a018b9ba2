"""What a mutant is (``Mutant``), and the paths and test files the mutant lists name."""
from typing import NamedTuple, Tuple


class Mutant(NamedTuple):
    id: str
    file: str
    original: str
    replacement: str
    description: str
    tests: Tuple[str, ...]
    slow: Tuple[str, ...] = ()


OPS = "linattn/ops/"
MOD = "fairseq_linattn/modules/"
LLN_T = ("tests/ops/test_lln.py",)
DIAG_T = ("tests/ops/test_lln_diag.py",)
LAVO_T = ("tests/ops/lavo/test_lavo.py", "tests/ops/lavo/test_lavo_impls.py")
SKY_T = ("tests/ops/skyformer/test_skyformer.py", "tests/ops/skyformer/test_skyformer_impls.py")
SKY_FUSED_T = ("tests/ops/skyformer/test_skyformer_fused.py",)
SKY_INVERSE_T = ("tests/ops/skyformer/test_nystrom_inverse_fused.py",)
LAVO_FUSED_T = ("tests/ops/lavo/test_lavo_fused.py",)
MODULE_T = ("tests/plugin/test_modules.py", "tests/plugin/test_module_padding.py",
            "tests/plugin/test_module_reference.py")
DECODE_T = ("tests/plugin/test_fairseq_decoding.py",)
MM_T = ("tests/ops/test_moment_matching.py",)
FAIRSEQ_SLOW = ("tests/plugin/test_fairseq_cli.py", "tests/plugin/test_fairseq_workflows.py")
