"""Every tool under linattn_tools starts one way, ``python -m linattn_tools.<tool>``, and answers --help; so does
every developer tool under dev/perf, ``python -m dev.perf.<tool>`` from the repository's root.

A tool is a module with a ``main``: it is started as ``python -m`` that module (it ends with
``if __name__ == "__main__"``), or, for a package's command-line module, as ``python -m`` the package
(whose ``__main__.py`` calls that ``main``). All of them run in one process, one after another.
"""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT

TOOLS = (ROOT / "linattn_tools", ROOT / "dev" / "perf")
GUARD = re.compile(r'^if __name__ == "__main__":', re.M)


def _module(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def tool_modules():
    """{module to start: file defining the main} for every file under ``TOOLS`` with a ``def main(``."""
    found = {}
    for path in sorted(p for tools in TOOLS for p in tools.rglob("*.py")):
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


# Each tool run as ``python -m`` runs it (``runpy.run_module`` as ``__main__``), with --help, in one process: the
# imports (torch, fairseq) once, not once a tool (40 s on 2 cores)
DRIVER = """
import contextlib, io, json, runpy, sys
out = {}
for module in sys.argv[1:]:
    stdout, stderr, code = io.StringIO(), io.StringIO(), 0
    sys.argv = [module, "--help"]
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as exit:
            code = exit.code if isinstance(exit.code, int) else (exit.code is not None)
        except BaseException as error:
            code, _ = 1, stderr.write(repr(error))
    out[module] = (code, stdout.getvalue(), stderr.getvalue())
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def helps():
    """Every tool's ``--help``: {module: (exit status, stdout, stderr)}."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    run = subprocess.run([sys.executable, "-c", DRIVER, *(m for m in MODULES if "(" not in m)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return {m: tuple(v) for m, v in json.loads(run.stdout.splitlines()[-1]).items()}


def test_the_tools_are_found():
    assert {"linattn_tools.fit_moments", "linattn_tools.cpu_ddp", "linattn_tools.analysis",
            "linattn_tools.reproduce", "linattn_tools.benchmark.attention", "linattn_tools.benchmark.model",
            "linattn_tools.benchmark.targets", "linattn_tools.recipes.gpu_selftest", "dev.perf.compare_ops",
            "dev.perf.tune_fused"} <= set(MODULES)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_tool_starts_with_python_m_and_help(helps, module):
    assert "(" not in module, f"{MODULES[module]} has a main but neither a __main__ guard nor a package __main__.py"
    code, stdout, stderr = helps[module]
    assert code == 0, f"python -m {module} --help exited {code}:\n{stderr[-2000:]}"
    assert "usage:" in stdout.lower(), stdout[:500]


# ``python -m`` one of our modules; not a pattern (``linattn_tools.<tool>``) or a prefix (``P="... -m pkg"``, ``$P.x``)
STARTED = re.compile(r'python -m\s+((?:linattn_tools|fairseq_linattn|linattn|dev)(?:\.\w+)*)(?![.<\w"])')


def _startable(module: str) -> bool:
    path = ROOT.joinpath(*module.split("."))
    return path.with_suffix(".py").is_file() or (path / "__main__.py").is_file()


def test_every_module_the_docs_start_exists():
    """Each ``python -m <our module>`` in a Markdown file (data/README.md, docs/, ...) names a module that exists."""
    missing = [f"{path.relative_to(ROOT)}: python -m {module}"
               for path in sorted(ROOT.rglob("*.md")) if not {".venv", ".git", "node_modules"} & set(path.parts)
               for module in STARTED.findall(path.read_text()) if not _startable(module)]
    assert not missing, missing
