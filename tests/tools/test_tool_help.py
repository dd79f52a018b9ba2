"""Every tool under linattn_tools starts one way, ``python -m linattn_tools.<tool>``, and answers --help.

A tool is a module with a ``main``: it is started as ``python -m`` that module (it ends with
``if __name__ == "__main__"``), or, for a package's command-line module, as ``python -m`` the package
(whose ``__main__.py`` calls that ``main``). All of them run at once, one process each.
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT

TOOLS = ROOT / "linattn_tools"
GUARD = re.compile(r'^if __name__ == "__main__":', re.M)


def _module(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def tool_modules():
    """{module to start: file defining the main} for every file under linattn_tools with a ``def main(``."""
    found = {}
    for path in sorted(TOOLS.rglob("*.py")):
        text = path.read_text()
        if not re.search(r"^def main\(", text, re.M):
            continue
        if path.name == "__main__.py":
            found[_module(path.parent)] = path
        elif GUARD.search(text):
            found[_module(path)] = path
        else:  # a package's command line: its __main__.py must call this main
            entry = path.parent / "__main__.py"
            calls = entry.is_file() and f"from .{path.stem} import main" in entry.read_text()
            found[_module(path.parent) if calls else _module(path) + " (no way to start it)"] = path
    return found


MODULES = tool_modules()


@pytest.fixture(scope="module")
def helps():
    """Every tool's ``--help``, run in parallel: {module: (exit status, stdout, stderr)}."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs = {m: subprocess.Popen([sys.executable, "-m", m, "--help"], cwd=ROOT, env=env, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for m in MODULES if "(" not in m}
    out = {}
    for m, p in procs.items():
        stdout, stderr = p.communicate(timeout=120)
        out[m] = (p.returncode, stdout, stderr)
    return out


def test_the_tools_are_found():
    assert {"linattn_tools.fit_moments", "linattn_tools.cpu_ddp", "linattn_tools.analysis",
            "linattn_tools.reproduce", "linattn_tools.benchmark.attention", "linattn_tools.benchmark.model",
            "linattn_tools.benchmark.compare_ops", "linattn_tools.recipes.gpu_selftest"} <= set(MODULES)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_tool_starts_with_python_m_and_help(helps, module):
    assert "(" not in module, f"{MODULES[module]} has a main but neither a __main__ guard nor a package __main__.py"
    code, stdout, stderr = helps[module]
    assert code == 0, f"python -m {module} --help exited {code}:\n{stderr[-2000:]}"
    assert "usage:" in stdout.lower(), stdout[:500]
