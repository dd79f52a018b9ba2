"""The layers stay visible: pure ops, no fairseq until it is needed, models registered whenever fairseq loads."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_importing_the_ops_imports_no_fairseq_and_patches_nothing():
    proc = python("import sys, torch\n"
                  "load = torch.load\n"
                  "import fairseq_linattn.ops, fairseq_linattn.methods\n"
                  "assert 'fairseq' not in sys.modules, 'fairseq imported'\n"
                  "assert torch.load is load\n"
                  "assert not [m for m in sys.modules if m.startswith('fairseq_linattn.modules')]\n")
    assert proc.returncode == 0, proc.stderr


def test_the_ops_hold_pure_tensor_functions():
    for path in (ROOT / "fairseq_linattn" / "ops").glob("*.py"):
        text = path.read_text()
        for banned in ("nn.Module", "torch.distributed", "argparse", "import fairseq", "from fairseq"):
            assert banned not in text, f"{path.name} uses {banned}"


def test_models_import_no_analysis():
    for path in (ROOT / "fairseq_linattn" / "models").glob("*.py"):
        assert "analysis" not in path.read_text().replace("the analysis layer", ""), path.name


def test_models_are_registered_when_fairseq_is_imported_after_the_plugin():
    # fairseq's import_user_module skips a user-dir already in sys.modules: registration must not depend on it
    proc = python("import fairseq_linattn.ops\n"
                  "import fairseq\n"
                  "from fairseq.models import ARCH_MODEL_REGISTRY\n"
                  "from fairseq.tasks import FairseqTask\n"
                  "assert {'linattn_roberta_tiny', 'linattn_lm_tiny', 'linattn_transformer_tiny'} <= set(ARCH_MODEL_REGISTRY)\n"
                  "assert FairseqTask._linattn_metrics\n")
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_models_are_registered_when_our_modules_import_fairseq_first():
    proc = python("from fairseq_linattn.modules.attention import build_attention\n"
                  "from fairseq.models import ARCH_MODEL_REGISTRY\n"
                  "assert 'linattn_lm_tiny' in ARCH_MODEL_REGISTRY\n")
    assert proc.returncode == 0, proc.stderr[-3000:]
