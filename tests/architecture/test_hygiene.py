"""The code stays readable: ruff clean, small files, no path or import tricks, method names dispatched only
where the methods are declared."""
import re
import subprocess
import sys

from helpers import ROOT

PACKAGES = ("linattn", "fairseq_linattn", "linattn_tools")
METHOD_NAMES = "softmax|lln|lln_diag|skyformer|kernelized|lavo|block_softmax"
# where a method's name may select code: its op, its module, its registry entry
DISPATCH_HOMES = ("linattn/ops/", "fairseq_linattn/modules/", "linattn/methods.py", "linattn/config.py")
# compares the experiment's own variants (softmax against LLN with several alpha, beta), not registry methods
DISPATCH_EXEMPT = {"linattn_tools/reproduce/lln_distribution.py"}
# where the fused implementation's name may be compared: the choice of implementations and its own files
FUSED_HOMES = ("linattn/ops/impls.py",)


def sources(*suffixes):
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    return [f for f in files if f.endswith(suffixes) and not f.startswith("data/") and (ROOT / f).exists()]


def test_ruff_is_clean():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_no_source_file_is_over_400_lines():
    long = {f: n for f in sources(".py", ".sh") if (n := len((ROOT / f).read_text().splitlines())) > 400}
    assert not long, long


def test_no_sys_path_edits_and_no_import_hooks():
    for f in sources(".py"):
        if f == "tests/architecture/test_hygiene.py":
            continue
        text = (ROOT / f).read_text()
        assert not re.search(r"sys\.path\.(insert|append)|sys\.path\s*\+?=", text), f
        assert "MetaPathFinder" not in text and "sys.meta_path.insert" not in text, f


def test_no_comment_cites_an_issue():
    for f in sources(".py", ".sh"):
        for i, line in enumerate((ROOT / f).read_text().splitlines(), 1):
            comment = line.split("#", 1)[1] if "#" in line else ""
            assert not re.search(r"\bissues? ?#?\d", comment, re.IGNORECASE), f"{f}:{i}: {line.strip()}"


def test_method_names_select_code_only_in_the_ops_the_modules_and_the_registry():
    pattern = re.compile(rf"(==|!=)\s*['\"]({METHOD_NAMES})['\"]|\bif\b.*\bin\s*\(['\"]({METHOD_NAMES})['\"]")
    for f in sources(".py"):
        if f.startswith(DISPATCH_HOMES) or f in DISPATCH_EXEMPT or not f.startswith(PACKAGES):
            continue
        for i, line in enumerate((ROOT / f).read_text().splitlines(), 1):
            assert not pattern.search(line), f"{f}:{i}: {line.strip()}"


def test_only_the_fused_files_and_the_choice_of_implementations_compare_with_its_name():
    """What an implementation does differently is declared in its file and read through the method's table
    (``impls.declares``, its ``not_supported_reasons``, a function of its own), so that adding one is one file per
    method and one entry in each table: no ``impl == "fused"`` in the library or the plugin."""
    name = r"""['"]fused['"]"""
    pattern = re.compile(rf"(==|!=)\s*{name}|{name}\s*(==|!=)|\b(not\s+)?in\s*[(\[{{][^)\]}}]*{name}")
    assert pattern.search('if impl == "fused":') and pattern.search("x = impl in ('looped', 'fused')")
    assert not pattern.search('IMPLEMENTATIONS = {"looped": looped, "fused": fused}')
    for f in sources(".py"):
        if not f.startswith(("linattn/", "fairseq_linattn/")) or f in FUSED_HOMES or f.endswith("/fused.py"):
            continue
        for i, line in enumerate((ROOT / f).read_text().splitlines(), 1):
            assert not pattern.search(line), f"{f}:{i}: {line.strip()}"
