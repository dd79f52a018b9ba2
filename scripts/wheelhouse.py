"""A wheelhouse: everything ``setup_env.sh --offline DIR`` installs on a machine without a network.

    python scripts/wheelhouse.py download DIR [--python-version 3.12] [--platform manylinux_2_28_x86_64]
                                              [--torch SPEC] [--pip-arg ARG ...]
    python scripts/wheelhouse.py check DIR          # does DIR suit this Python? (one line; exit 1 if not)
    python scripts/wheelhouse.py requirements       # the project's requirements, torch left out

``download`` (run by ``setup_env.sh --download`` with a Python that has pip and setuptools) puts into DIR: the
fairseq sdist (built on the target machine, about 30 s), binary wheels of every requirement of setup.py (the
``test`` extra included) and of the build tools (numpy, Cython, setuptools, wheel) for the target Python and
platform, and ``wheelhouse.json`` saying which. torch is left out unless ``--torch SPEC`` asks for it (the target
usually has its own CUDA build). A requirement published only as an sdist (antlr4-python3-runtime, which omegaconf
needs) is built here into a pure-Python wheel; one that needs compiling and has no wheel for the target stops the
download with its name.
"""
import argparse
import email.parser
import json
import platform
import re
import runpy
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import fairseq_build

ROOT = Path(__file__).resolve().parents[1]
BUILD_TOOLS = ["numpy", "cython", "wheel", "setuptools>=70.1"]
# torch releases pin setuptools both ways (2.11: <82; 2.13: >=77.0.3): a second setuptools for the older ones, so
# that pip on the target finds one that suits the torch there
ALSO = ["setuptools<82"]
MANIFEST = "wheelhouse.json"
LEGACY_MANYLINUX = {"manylinux2014": 17, "manylinux2010": 12, "manylinux1": 5}


def requirement_name(spec: str) -> str:
    return re.split(r"[\s<>=!~;\[(]", spec.strip(), maxsplit=1)[0].lower().replace("_", "-")


def requirements(root: Path = ROOT, extras=("test",)) -> list:
    """``install_requires`` and the ``extras`` of ``root/setup.py`` (read by running it with ``setup`` caught),
    torch left out."""
    import setuptools

    captured = {}
    real = setuptools.setup
    setuptools.setup = lambda **kw: captured.update(kw)
    try:
        runpy.run_path(str(root / "setup.py"))
    finally:
        setuptools.setup = real
    specs = list(captured["install_requires"])
    for extra in extras:
        specs += captured.get("extras_require", {}).get(extra, [])
    return [s for s in specs if requirement_name(s) != "torch"]


def platforms(tag: str) -> list:
    """pip matches ``--platform`` tags literally: ``manylinux_2_28_x86_64`` becomes every manylinux tag a
    glibc-2.28 machine accepts (2_28 down to 2_5, with the legacy names), so wheels tagged only
    ``manylinux2014_x86_64`` are found too."""
    legacy = re.fullmatch(r"(manylinux2014|manylinux2010|manylinux1)_(\w+)", tag)
    match = re.fullmatch(r"manylinux_(\d+)_(\d+)_(\w+)", tag)
    if legacy:
        major, minor, arch = 2, LEGACY_MANYLINUX[legacy.group(1)], legacy.group(2)
    elif match:
        major, minor, arch = int(match.group(1)), int(match.group(2)), match.group(3)
    else:
        return [tag]
    tags = [f"manylinux_{major}_{m}_{arch}" for m in range(minor, 4, -1)] if major == 2 else [tag]
    tags += [f"{name}_{arch}" for name, m in LEGACY_MANYLINUX.items() if major == 2 and m <= minor]
    return tags


def target_options(python_version, platform_tag) -> list:
    """pip's options for another interpreter or platform (binary wheels only, as pip requires then)."""
    opts = ["--only-binary=:all:"]
    if python_version:
        nodot = python_version.replace(".", "")
        opts += ["--python-version", python_version, "--implementation", "cp", "--abi", f"cp{nodot}"]
    for tag in platforms(platform_tag) if platform_tag else []:
        opts += ["--platform", tag]
    return opts


def wheels_in(directory: Path) -> dict:
    """{canonical name: [(version, metadata)]} of the wheels in ``directory``."""
    from packaging.utils import canonicalize_name
    from packaging.version import Version

    found = {}
    for path in directory.glob("*.whl"):
        with zipfile.ZipFile(path) as whl:
            name = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
            meta = email.parser.Parser().parsestr(whl.read(name).decode("utf-8"))
        found.setdefault(canonicalize_name(meta["Name"]), []).append((Version(meta["Version"]), meta))
    return found


def left_out(directory: Path, specs, python_version: str) -> list:
    """Requirements of ``specs`` (and of their wheels in ``directory``, transitively) that no wheel there
    satisfies, with environment markers read for Python ``python_version``: pip evaluates markers for the Python
    that runs it, so a wheelhouse for 3.10 made by 3.11 lacks e.g. ``tomli; python_version < "3.11"``."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    target = {"python_version": python_version, "python_full_version": f"{python_version}.0"}
    wheels, missing, seen = wheels_in(directory), [], set()
    todo = [Requirement(s) for s in specs]
    while todo:
        req = todo.pop()
        key = (canonicalize_name(req.name), str(req.specifier), tuple(sorted(req.extras)))
        if key in seen:
            continue
        seen.add(key)
        fits = [meta for version, meta in wheels.get(key[0], []) if req.specifier.contains(version, prereleases=True)]
        if not fits:
            missing.append(f"{req.name}{'[' + ','.join(sorted(req.extras)) + ']' if req.extras else ''}{req.specifier}")
            continue
        for dep in map(Requirement, fits[0].get_all("Requires-Dist") or []):
            if dep.marker is None or any(dep.marker.evaluate({**target, "extra": e}) for e in req.extras or [""]):
                todo.append(dep)
    return sorted(set(missing))


def pip(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
                          capture_output=True, text=True)


def download(directory: Path, python_version=None, platform_tag=None, torch=None, pip_args=()) -> dict:
    directory.mkdir(parents=True, exist_ok=True)
    sdist = fairseq_build.fetch(directory, pip_args)
    specs = requirements() + BUILD_TOOLS + ([torch] if torch else [])
    built = []
    while True:  # each round builds one sdist-only requirement into a pure wheel, then tries again
        proc = pip("download", "-q", "-d", str(directory), "--find-links", str(directory),
                   *target_options(python_version, platform_tag), *pip_args, *specs)
        if proc.returncode == 0:
            break
        missing = re.search(r"No matching distribution found for (\S+)", proc.stderr)
        if not missing or missing.group(1) in built:
            sys.stderr.write(proc.stderr[-4000:])
            raise SystemExit(f"wheelhouse: {missing.group(1) if missing else 'pip download'} has no wheel for "
                             f"Python {python_version or 'this'} on {platform_tag or 'this platform'} and none "
                             "could be built here: build it on the target machine and put it in "
                             f"{directory}")
        spec = missing.group(1)
        built.append(spec)
        print(f"[wheelhouse] {spec}: no wheel published; building a pure-Python one", file=sys.stderr)
        proc = pip("wheel", "-q", "--no-deps", "-w", str(directory), *pip_args, spec)
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr[-4000:])
            raise SystemExit(f"wheelhouse: could not build a wheel of {spec}")
    target = python_version or "%d.%d" % sys.version_info[:2]
    for _ in range(5):  # what pip left out for the target's markers, with what that needs
        missing = left_out(directory, specs, target)
        if not missing:
            break
        print(f"[wheelhouse] for Python {target} also: {', '.join(missing)}", file=sys.stderr)
        proc = pip("download", "-q", "-d", str(directory), "--find-links", str(directory),
                   *target_options(python_version, platform_tag), *pip_args, *missing)
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr[-4000:])
            raise SystemExit(f"wheelhouse: could not download {', '.join(missing)} for Python {target}")
    else:
        raise SystemExit(f"wheelhouse: still missing for Python {target}: {', '.join(missing)}")
    for spec in ALSO:
        proc = pip("download", "-q", "--no-deps", "-d", str(directory), *target_options(python_version, platform_tag),
                   *pip_args, spec)
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr[-4000:])
            raise SystemExit(f"wheelhouse: could not download {spec}")
    manifest = {
        "python": python_version or "%d.%d" % sys.version_info[:2],
        "platform": platforms(platform_tag) if platform_tag else [sysconfig.get_platform()],
        "fairseq_sdist": sdist.name,
        "torch": torch,
        "requirements": specs + ALSO,
        "built_here": built,
        "made_on": f"{platform.node()} (Python {platform.python_version()}, {sysconfig.get_platform()})",
    }
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def check(directory: Path) -> str:
    """One line: what DIR holds for this Python, or why it does not suit it (SystemExit)."""
    path = directory / MANIFEST
    if not path.is_file():
        raise SystemExit(f"setup_env.sh: {directory} is not a wheelhouse (no {MANIFEST}): make one on a machine "
                         f"with a network: bash scripts/setup_env.sh --download {directory}")
    manifest = json.loads(path.read_text())
    here = "%d.%d" % sys.version_info[:2]
    if manifest["python"] != here:
        raise SystemExit(f"setup_env.sh: {directory} holds wheels for Python {manifest['python']}, this Python is "
                         f"{here}: make one with --download DIR --python-version {here}")
    torch = sorted(p.name for p in directory.glob("torch-*.whl"))
    return f"wheelhouse for Python {manifest['python']} ({', '.join(manifest['platform'][:1])}); " \
           f"torch: {torch[-1] if torch else 'none'}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python scripts/wheelhouse.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("download")
    d.add_argument("dir", type=Path)
    d.add_argument("--python-version", help="X.Y of the target's Python (default: this one's)")
    d.add_argument("--platform", help="the target's wheel platform, e.g. manylinux_2_28_x86_64 (default: this one)")
    d.add_argument("--torch", help="also download this torch (e.g. torch==2.6.0; an index for CUDA builds: "
                                   "PIP_EXTRA_INDEX_URL)")
    d.add_argument("--pip-arg", action="append", default=[], help="passed to every pip call")
    c = sub.add_parser("check")
    c.add_argument("dir", type=Path)
    sub.add_parser("requirements")
    args = parser.parse_args(argv)
    if args.command == "download":
        if args.python_version and not re.fullmatch(r"3\.1[0-2]", args.python_version):
            parser.error(f"--python-version {args.python_version}: fairseq 0.12 runs on Python 3.10, 3.11 or 3.12")
        m = download(args.dir, args.python_version, args.platform, args.torch, args.pip_arg)
        n = len(list(args.dir.glob("*.whl")))
        print(f"[wheelhouse] {args.dir}: {n} wheels and {m['fairseq_sdist']} for Python {m['python']} on "
              f"{m['platform'][0]}; torch: {m['torch'] or 'left out'}")
    elif args.command == "check":
        print(check(args.dir))
    else:
        print("\n".join(requirements()))


if __name__ == "__main__":
    main()
