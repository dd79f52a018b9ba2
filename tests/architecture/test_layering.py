"""The layers stay visible: ``linattn`` (pure PyTorch) -> ``fairseq_linattn`` (the plugin) -> ``linattn_tools``."""
import ast
import re
import subprocess
import sys
from graphlib import CycleError, TopologicalSorter
from typing import List, Optional

from helpers import ROOT

SHIPPED = ("linattn", "fairseq_linattn", "linattn_tools")  # setup.py's packages
# the developer measurement tools, in dev/perf (``python -m dev.perf.<tool>``): none ships again under these names
# (``profiling``: the package of ``saved``'s byte count and the dispatch count, now linattn_tools.benchmark.dispatch)
DEVELOPER_TOOLS = ("kernel_resources", "tune_fused", "fused_ops", "compare_ops", "gpu_shape", "host_time", "compile",
                   "traffic", "profile_step", "saved")


def python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)


def imports(package: str):
    """(path, imported module) for every import statement under ROOT/package."""
    for path in sorted((ROOT / package).rglob("*.py")):
        for match in re.finditer(r"^\s*(?:from\s+([\w.]+)\s+import|import\s+([\w.]+))", path.read_text(), re.MULTILINE):
            yield path.relative_to(ROOT), match.group(1) or match.group(2)


def import_graph(*packages: str):
    """{module: the modules of ``packages`` it imports}, read from every import statement of each file (in
    functions and under ``if TYPE_CHECKING`` too), relative imports resolved; ``from a import b`` imports the
    module ``a.b`` where there is one, else ``a``. Importing ``a.b`` is not counted as importing ``a``."""
    files = {}
    for package in packages:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in files.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]  # its package
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                source = ".".join((here[:len(here) + 1 - node.level] if node.level else [])
                                  + ([node.module] if node.module else []))
                imported.update(f"{source}.{alias.name}" if f"{source}.{alias.name}" in files else source
                                for alias in node.names)
        graph[name] = imported & set(files)
    return graph


def test_the_import_graph_resolves_relative_imports_and_submodules():
    graph = import_graph("linattn", "fairseq_linattn")
    assert {"fairseq_linattn.modules.base", "linattn.ops"} <= graph["fairseq_linattn.modules.lln"]  # .base; ops
    assert "fairseq_linattn.modules.build" in graph["fairseq_linattn.modules"]  # the package's __init__.py
    assert "fairseq_linattn.modules" not in graph["fairseq_linattn.modules.lln"]


def import_circle(graph) -> Optional[List[str]]:
    """One circle of ``graph`` (its modules in import order, the first repeated at the end), or None."""
    try:
        TopologicalSorter(graph).prepare()
    except CycleError as e:
        return list(reversed(e.args[1]))
    return None


def test_an_import_circle_is_found_and_named_in_import_order():
    graph = {"a.common": {"a.speed"}, "a.speed": {"a.paths"}, "a.paths": {"a.common"}, "a.ledger": {"a.common"}}
    circle = import_circle(graph)  # each module imports the next
    assert circle and circle[0] == circle[-1] and all(b in graph[a] for a, b in zip(circle, circle[1:])), circle
    assert import_circle({"a.ledger": {"a.common", "a.speed"}, "a.speed": {"a.common"}, "a.common": set()}) is None


def test_no_import_circle_in_the_shipped_packages():
    """Over every module of the three packages ``setup.py`` installs, imports inside functions counted (a lazy import
    breaks a circle at import time only: the two modules still need each other)."""
    circle = import_circle(import_graph(*SHIPPED))
    assert circle is None, f"import circle: {' -> '.join(circle)}"


def test_importing_linattn_imports_no_fairseq_and_patches_nothing():
    proc = python("import sys, torch\n"
                  "load = torch.load\n"
                  "import linattn.ops, linattn.methods, linattn.config, linattn.analysis\n"
                  "assert 'fairseq' not in sys.modules, 'fairseq imported'\n"
                  "assert torch.load is load\n"
                  "assert not [m for m in sys.modules if m.startswith(('fairseq_linattn', 'linattn_tools'))]\n")
    assert proc.returncode == 0, proc.stderr


def test_the_registry_the_options_and_their_tools_import_neither_torch_nor_fairseq():
    # the recipe scripts' type check (methods_cli) starts before anything else: it must stay quick
    proc = python("import sys\n"
                  "import linattn.methods, linattn.config, linattn_tools.methods_cli\n"
                  "from linattn.config import AttentionConfig\nfrom linattn_tools.methods_extra import benchmarked\n"
                  "assert AttentionConfig is linattn.config.AttentionConfig and 'block_softmax' in benchmarked()\n"
                  "assert not [m for m in sys.modules if m.split('.')[0] in ('torch', 'fairseq', 'numpy')]\n")
    assert proc.returncode == 0, proc.stderr


def test_each_layer_imports_only_the_layers_below_it():
    for path, module in imports("linattn"):
        assert not module.startswith(("fairseq", "linattn_tools")), f"{path} imports {module}"
    for path, module in imports("fairseq_linattn"):
        assert not module.startswith("linattn_tools"), f"{path} imports {module}"


def test_the_ops_hold_pure_tensor_functions():
    paths = list((ROOT / "linattn" / "ops").rglob("*.py"))
    assert len(paths) >= 10
    for path in paths:
        text = path.read_text()
        for banned in ("nn.Module", "torch.distributed", "argparse", "import fairseq", "from fairseq"):
            assert banned not in text, f"{path.name} uses {banned}"


def test_models_import_no_analysis():
    for path in (ROOT / "fairseq_linattn" / "models").glob("*.py"):
        assert "analysis" not in path.read_text().replace("the analysis layer", ""), path.name


def test_the_user_dir_import_registers_the_plugin_with_plain_imports_and_loads_no_tool_code():
    # what `fairseq-train --user-dir fairseq_linattn` does: fairseq imports the directory's basename
    proc = python("import sys\n"
                  "from fairseq import utils\n"
                  "from argparse import Namespace\n"
                  "utils.import_user_module(Namespace(user_dir='fairseq_linattn'))\n"
                  "from fairseq.models import ARCH_MODEL_REGISTRY\n"
                  "from fairseq.tasks import FairseqTask\n"
                  "tiny = {'linattn_roberta_tiny', 'linattn_lm_tiny', 'linattn_transformer_tiny'}\n"
                  "assert tiny <= set(ARCH_MODEL_REGISTRY)\n"
                  "assert FairseqTask._linattn_metrics\n"
                  "ours = [f for f in sys.meta_path if type(f).__module__.startswith(('fairseq_linattn', 'linattn'))]\n"
                  "assert not ours, f'import hooks installed: {ours}'\n"
                  "tools = [m for m in sys.modules if m.startswith('linattn_tools')]\n"
                  "assert not tools, tools\n"
                  "assert not [m for m in sys.modules if m.startswith(('matplotlib', 'linattn.analysis.synthetic'))]\n")
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_models_are_registered_when_a_module_of_the_plugin_is_imported_first():
    proc = python("from fairseq_linattn.modules.build import build_attention\n"
                  "from fairseq.models import ARCH_MODEL_REGISTRY\n"
                  "assert 'linattn_lm_tiny' in ARCH_MODEL_REGISTRY\n")
    assert proc.returncode == 0, proc.stderr[-3000:]


def setup_packages() -> List[str]:
    """The packages ``setup.py`` installs: its ``find_packages(...)`` call, run on this tree."""
    from setuptools import find_packages

    call = next(node for node in ast.walk(ast.parse((ROOT / "setup.py").read_text()))
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "find_packages")
    return find_packages(str(ROOT), **{k.arg: ast.literal_eval(k.value) for k in call.keywords})


def test_setup_installs_the_three_packages_and_neither_dev_nor_tests():
    found = setup_packages()
    assert {p.split(".")[0] for p in found} == set(SHIPPED), found
    assert {"linattn_tools.benchmark", "linattn.ops.triton"} <= set(found)


def dev_references(source: str):
    """(line, what) of each import of ``dev`` in ``source`` and each string naming a module of ``dev`` (as
    ``python -m`` or ``importlib`` take it)."""
    for node in ast.walk(ast.parse(source)):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                 else [node.value] if isinstance(node, ast.Constant) and isinstance(node.value, str) else [])
        for name in names:
            if re.fullmatch(r"dev(\.\w+)*", name):
                yield node.lineno, name


def test_no_shipped_module_imports_or_runs_dev_and_no_developer_tool_ships():
    example = ("import os\nfrom dev.perf import traffic\nfrom . import dev\nimport dev\n"
               "cmd = ['-m', 'dev.perf.tune_fused']\ntext = 'python -m dev.perf.traffic'\n")
    assert sorted(dev_references(example)) == [(2, "dev.perf"), (4, "dev"), (5, "dev.perf.tune_fused")]
    found = [(str(path.relative_to(ROOT)), line, name) for package in SHIPPED
             for path in sorted((ROOT / package).rglob("*.py")) for line, name in dev_references(path.read_text())]
    assert not found, f"shipped code needs dev/, which is not installed: {found}"
    shipped = [path.relative_to(ROOT) for package in SHIPPED for path in (ROOT / package).rglob("*.py")]
    back = [str(path) for path in shipped if {path.stem, *path.parts[:-1]} & {*DEVELOPER_TOOLS, "profiling"}]
    assert not back, f"developer tools under the shipped packages (their place: dev/perf): {back}"
    assert all((ROOT / "dev" / "perf" / f"{tool}.py").is_file() for tool in DEVELOPER_TOOLS)
