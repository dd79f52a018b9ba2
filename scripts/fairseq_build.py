"""fairseq 0.12 from its sdist, with only the compiled parts the plugin's workflows call (run by setup_env.sh).

    python scripts/fairseq_build.py fetch DIR                      # the sdist into DIR (pip download)
    python scripts/fairseq_build.py sdist DIR                      # its path in DIR (a wheelhouse)
    python scripts/fairseq_build.py wheel SDIST DIR [--extensions minimal|all]

fairseq-fixed's setup.py imports torch (``torch.utils.cpp_extension``) and lists torch in its build requirements,
so pip would put a second, multi-GB torch into an isolated build environment just to read the sdist's metadata.
Both commands run pip without build isolation, with a stand-in ``torch.utils.cpp_extension`` first on
PYTHONPATH (only for that pip call; the real torch is never imported): its ``CppExtension`` declares the
torch extensions as usual and its ``BuildExtension`` leaves them out of the build.

``minimal`` (the default) builds the three extensions that training, eval-lm and generate call:
``fairseq.data.data_utils_fast`` (batching), ``fairseq.data.token_block_utils_fast`` (LM and masked-LM blocks)
and ``fairseq.libbleu`` (fairseq-generate's default BLEU scorer). Left out: ``fairseq.libbase`` (BASE layers'
balanced assignment), ``fairseq.libnat`` (Levenshtein / non-autoregressive translation), the examples'
alignment bindings and the CUDA kernels (``libnat_cuda``, ``ngram_repeat_block_cuda``: fairseq falls back to
PyTorch for n-gram blocking). ``all`` runs fairseq's own build with the real torch (minutes).
"""
import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FAIRSEQ_SPEC = "fairseq-fixed==0.12.3.1"
MINIMAL = ("fairseq.data.data_utils_fast", "fairseq.data.token_block_utils_fast", "fairseq.libbleu")
LEFT_OUT = "libbase, libnat, the CUDA kernels"

STUB = '''"""Stand-in for torch.utils.cpp_extension while pip reads or builds fairseq's sdist (fairseq_build.py)."""
import os

from setuptools import Extension
from setuptools.command.build_ext import build_ext

KEEP = set(os.environ.get("LINATTN_FAIRSEQ_EXTENSIONS", "").split(","))


def CppExtension(name, sources, *args, **kwargs):
    return Extension(name, sources, *args, language="c++", **kwargs)


class BuildExtension(build_ext):
    """Builds only the extensions named in KEEP, in parallel."""

    @classmethod
    def with_options(cls, **options):
        return cls

    def finalize_options(self):
        super().finalize_options()
        self.extensions = [e for e in self.extensions if e.name in KEEP]
        self.distribution.ext_modules = self.extensions
        self.parallel = self.parallel or os.cpu_count() or 1
'''


def stub_dir(root: Path) -> Path:
    """``root`` holding a ``torch`` package with only ``utils.cpp_extension`` (the stand-in above)."""
    package = root / "torch" / "utils"
    package.mkdir(parents=True)
    (root / "torch" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "cpp_extension.py").write_text(STUB)
    return root


def pip(args, stub: bool, extensions=MINIMAL) -> None:
    """``python -m pip ARGS`` with the stand-in torch first on PYTHONPATH (``stub``) and no CUDA_HOME (fairseq's
    setup.py builds CUDA kernels whenever the variable is set, even empty or wrong)."""
    env = dict(os.environ)
    cuda_home = env.pop("CUDA_HOME", "")
    if not stub and os.path.isfile(os.path.join(cuda_home, "bin", "nvcc")):
        env["CUDA_HOME"] = cuda_home
    with tempfile.TemporaryDirectory(prefix="fairseq-stub-") as tmp:
        if stub:
            env["PYTHONPATH"] = os.pathsep.join([str(stub_dir(Path(tmp))), *filter(None, [env.get("PYTHONPATH")])])
            env["LINATTN_FAIRSEQ_EXTENSIONS"] = ",".join(extensions)
        cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-6000:] + proc.stderr[-6000:])
        raise SystemExit(f"fairseq_build: failed ({proc.returncode}): {' '.join(cmd)}")


def fetch(directory: Path, pip_args=()) -> Path:
    """The sdist of ``FAIRSEQ_SPEC`` into ``directory`` (from the index, or pip's cache); returns its path."""
    directory.mkdir(parents=True, exist_ok=True)
    pip(["download", "-q", "--no-deps", "--no-binary", ":all:", "--no-build-isolation", "-d", str(directory),
         *pip_args, FAIRSEQ_SPEC], stub=True)
    return sdist_in(directory)


def sdist_in(directory: Path) -> Path:
    name, version = FAIRSEQ_SPEC.replace("-", "_").split("==")
    path = directory / f"{name}-{version}.tar.gz"
    if not path.is_file():
        raise SystemExit(f"fairseq_build: {path} is missing (bash scripts/setup_env.sh --download puts it there)")
    return path


def wheel(sdist: Path, directory: Path, extensions: str = "minimal") -> Path:
    """A wheel of ``sdist`` for this Python in ``directory``; returns its path."""
    directory.mkdir(parents=True, exist_ok=True)
    before = set(directory.glob("*.whl"))
    pip(["wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(directory), str(sdist)],
        stub=extensions == "minimal")
    built = sorted(set(directory.glob("*.whl")) - before) or sorted(directory.glob("fairseq_fixed-*.whl"))
    return built[-1]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python scripts/fairseq_build.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    f = sub.add_parser("fetch", help="download the sdist into DIR")
    f.add_argument("dir", type=Path)
    s = sub.add_parser("sdist", help="the sdist's path in DIR (an error if it is not there)")
    s.add_argument("dir", type=Path)
    w = sub.add_parser("wheel", help="build a wheel of SDIST for this Python into DIR")
    w.add_argument("sdist", type=Path)
    w.add_argument("dir", type=Path)
    w.add_argument("--extensions", choices=("minimal", "all"), default="minimal")
    args = parser.parse_args(argv)
    if args.command in ("fetch", "sdist"):
        print(fetch(args.dir) if args.command == "fetch" else sdist_in(args.dir))
        return
    t0 = time.monotonic()
    path = wheel(args.sdist, args.dir, args.extensions)
    what = ("extensions: " + ", ".join(m.rsplit(".", 1)[1] for m in MINIMAL) + f"; left out: {LEFT_OUT}"
            if args.extensions == "minimal" else "all of fairseq's extensions")
    print(f"{path}\t{time.monotonic() - t0:.0f} s\t{what}")


if __name__ == "__main__":
    main()
