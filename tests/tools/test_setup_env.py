"""scripts/setup_env.sh and its helpers: the refusals that come before any work, the wheelhouse's platform tags and
requirement list, the fairseq build's stand-in torch; and (slow) a wheelhouse made here, then an offline install
from it with the network cut, over a Python that already has torch (as a container image's)."""
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from helpers import ROOT
from packaging.requirements import Requirement

SETUP = str(ROOT / "scripts" / "setup_env.sh")


def load(name):
    """scripts/NAME.py as a module (scripts/ is no package; wheelhouse imports fairseq_build by name)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


fairseq_build = load("fairseq_build")
wheelhouse = load("wheelhouse")


def setup_env(*args, env=None, timeout=60, prefix=()):
    return subprocess.run([*prefix, "bash", SETUP, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def test_help_names_the_three_cases():
    proc = setup_env("--help")
    assert proc.returncode == 0
    for words in ("--offline DIR", "--download DIR", "--python-version", "--platform", "--torch", "PYTHON",
                  "never a second torch", "FAIRSEQ_EXTENSIONS=all"):
        assert words in proc.stdout, words


@pytest.mark.parametrize("args,message", [
    (["--frobnicate"], "unexpected argument '--frobnicate'"),
    (["--offline"], "--offline needs a value"),
    (["--python-version", "3.12"], "go with --download DIR"),
])
def test_bad_arguments_stop_with_one_line(tmp_path, args, message):
    proc = setup_env(*args, env={"VENV": str(tmp_path / "v")})
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0 and message in proc.stderr
    assert not (tmp_path / "v").exists()


def test_an_unsupported_python_is_refused_before_any_work(tmp_path):
    fake = tmp_path / "python3.9"
    fake.write_text("#!/bin/sh\necho 3.9\n")
    fake.chmod(0o755)
    proc = setup_env(env={"VENV": str(tmp_path / "v"), "PYTHON": str(fake)})
    assert proc.returncode == 2 and "Python 3.9: fairseq 0.12 runs on 3.10, 3.11 or 3.12" in proc.stderr
    assert not (tmp_path / "v").exists()
    proc = setup_env("--download", str(tmp_path / "w"), "--python-version", "3.13")
    assert proc.returncode == 2 and "Python 3.13" in proc.stderr and not (tmp_path / "w").exists()


def test_a_wheelhouse_for_another_python_is_refused_before_any_work(tmp_path):
    proc = setup_env("--offline", str(tmp_path), env={"VENV": str(tmp_path / "v"), "PYTHON": sys.executable})
    assert proc.returncode == 2 and "is not a wheelhouse" in proc.stderr and "--download" in proc.stderr
    here = "%d.%d" % sys.version_info[:2]
    other = "3.12" if here == "3.10" else "3.10"
    (tmp_path / "wheelhouse.json").write_text(json.dumps({"python": other, "platform": ["x"]}))
    proc = setup_env("--offline", str(tmp_path), env={"VENV": str(tmp_path / "v"), "PYTHON": sys.executable})
    assert proc.returncode == 2 and f"holds wheels for Python {other}, this Python is {here}" in proc.stderr
    assert not (tmp_path / "v").exists()


def test_a_venv_made_over_another_python_is_not_reused_silently(tmp_path):
    venv = tmp_path / "v"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    (venv / ".linattn-base").write_text("/some/other/python\n")
    proc = setup_env(env={"VENV": str(venv), "PYTHON": sys.executable})
    assert proc.returncode == 2 and "was made over /some/other/python" in proc.stderr and "rm -rf" in proc.stderr


def test_platform_tags_cover_older_manylinux_names():
    tags = wheelhouse.platforms("manylinux_2_28_x86_64")
    assert tags[0] == "manylinux_2_28_x86_64" and "manylinux_2_17_x86_64" in tags
    assert {"manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"} <= set(tags)
    assert "manylinux_2_29_x86_64" not in tags
    assert "manylinux_2_24_x86_64" not in wheelhouse.platforms("manylinux2014_x86_64")
    assert wheelhouse.platforms("macosx_11_0_arm64") == ["macosx_11_0_arm64"]
    opts = wheelhouse.target_options("3.12", "manylinux2014_aarch64")
    assert opts[:7] == ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp", "--abi",
                        "cp312"] and "manylinux2014_aarch64" in opts


def test_the_wheelhouse_takes_every_requirement_but_torch():
    names = {Requirement(s).name for s in wheelhouse.requirements()}
    assert "torch" not in names
    assert {"datasets", "sentencepiece", "hydra-core", "numpy", "pytest", "ruff"} <= names  # runtime and test extra


def fake_wheel(directory: Path, name: str, version: str, *requires: str) -> None:
    with zipfile.ZipFile(directory / f"{name}-{version}-py3-none-any.whl", "w") as whl:
        lines = [f"Name: {name}", f"Version: {version}", *(f"Requires-Dist: {r}" for r in requires)]
        whl.writestr(f"{name}-{version}.dist-info/METADATA", "\n".join(lines) + "\n")


def test_requirements_pip_left_out_for_the_target_python_are_found(tmp_path):
    # pip reads environment markers for the Python that runs it: the wheelhouse is walked again for the target's
    fake_wheel(tmp_path, "a", "1.0", 'b>=1; python_version < "3.11"', "c[x]>=2", "e<1")
    fake_wheel(tmp_path, "c", "2.0", 'd; extra == "x"', 'f; extra == "y"')
    fake_wheel(tmp_path, "e", "0.5")
    assert wheelhouse.left_out(tmp_path, ["a"], "3.10") == ["b>=1", "d"]
    assert wheelhouse.left_out(tmp_path, ["a"], "3.12") == ["d"]
    assert wheelhouse.left_out(tmp_path, ["a", "e>=1", "g"], "3.12") == ["d", "e>=1", "g"]


def test_the_stand_in_torch_builds_only_the_extensions_asked_for(tmp_path):
    stub = fairseq_build.stub_dir(tmp_path / "stub")
    code = """
from setuptools import Distribution, Extension
from torch.utils.cpp_extension import BuildExtension, CppExtension
dist = Distribution({"ext_modules": [Extension("fairseq.libbleu", ["a.cpp"]), CppExtension("fairseq.libnat", ["b.cpp"]),
                                     Extension("fairseq.data.data_utils_fast", ["c.pyx"])]})
cmd = BuildExtension(dist)
cmd.ensure_finalized()
print(",".join(e.name for e in cmd.extensions), cmd.parallel > 0)
"""
    env = {**os.environ, "PYTHONPATH": str(stub), "LINATTN_FAIRSEQ_EXTENSIONS": ",".join(fairseq_build.MINIMAL)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["fairseq.libbleu,fairseq.data.data_utils_fast", "True"]


def test_a_wheelhouse_without_the_fairseq_sdist_says_where_it_comes_from(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "fairseq_build.py"), "sdist", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "fairseq_fixed-0.12.3.1.tar.gz is missing" in proc.stderr
    assert "setup_env.sh --download" in proc.stderr


def python_with_torch(image: Path) -> Path:
    """A venv standing in for a container image's Python: torch and what torch needs (links to this
    interpreter's copies), nothing else. Returns its python."""
    base = Path(sys.base_prefix) / "bin" / ("python%d.%d" % sys.version_info[:2])
    subprocess.run([str(base), "-m", "venv", "--without-pip", str(image)], check=True)
    site = next(image.glob("lib/python*/site-packages"))
    todo, seen = ["torch"], set()
    while todo:
        dist = metadata.distribution(todo.pop())
        if dist.metadata["Name"].lower() in seen:
            continue
        seen.add(dist.metadata["Name"].lower())
        todo += [r.name for r in map(Requirement, dist.requires or [])
                 if r.marker is None or r.marker.evaluate({"extra": ""})]
        for top in {Path(str(f)).parts[0] for f in dist.files or []} - {"..", "__pycache__"}:
            if (Path(dist.locate_file(top))).exists() and not (site / top).exists():
                (site / top).symlink_to(dist.locate_file(top))
    return image / "bin" / "python"


def network_cut():
    """A command prefix that runs its command without a network (a new network namespace), where allowed."""
    if shutil.which("unshare") and subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode == 0:
        return ("unshare", "-n")
    return ()


@pytest.mark.slow
def test_offline_install_from_a_wheelhouse_keeps_the_image_s_torch(tmp_path):
    house, venv = tmp_path / "wheelhouse", tmp_path / "venv"
    start = time.time()
    proc = setup_env("--download", str(house), env={"PYTHON": sys.executable}, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    downloaded = time.time() - start
    assert (house / "fairseq_fixed-0.12.3.1.tar.gz").is_file() and not list(house.glob("torch-*"))
    assert list(house.glob("antlr4_python3_runtime-*-none-any.whl")), "the sdist-only requirement, built here"

    image = tmp_path / "image"
    offline = {"VENV": str(venv), "PYTHON": str(python_with_torch(image)), "PIP_CONFIG_FILE": os.devnull,
               "PIP_FIND_LINKS": "", "PIP_INDEX_URL": "http://127.0.0.1:9/none", "PIP_EXTRA_INDEX_URL": "",
               "http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9"}
    start = time.time()
    proc = setup_env("--offline", str(house), env=offline, timeout=900, prefix=network_cut())
    installed = time.time() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    print(f"download {downloaded:.0f} s, offline install {installed:.0f} s\n{out}")
    assert f"torch {metadata.version('torch')}" in out and "kept, from " + str(image) in out
    assert "built in" in out and "left out: libbase, libnat" in out
    assert not list(venv.glob("lib/python*/site-packages/torch")), "a second torch in the venv"

    py = str(venv / "bin" / "python")
    check = "import torch, fairseq_linattn, fairseq.data.data_utils_fast, datasets, sentencepiece; " \
            "print(torch.__file__)"
    proc = subprocess.run([py, "-c", check], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().startswith(str(image)), proc.stderr[-3000:]
    train = str(venv / "bin" / "fairseq-train")
    proc = subprocess.run([train, "--help"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "--user-dir" in proc.stdout
    proc = subprocess.run([train, str(tmp_path / "none"), "--user-dir", str(ROOT / "fairseq_linattn"), "--task",
                           "language_modeling", "--arch", "linattn_lm_tiny", "--decoder-attention-type", "skyformer"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "error: --decoder-attention-type" in proc.stderr  # the plugin parses

    start = time.time()  # a second run finds everything in place
    proc = setup_env("--offline", str(house), env=offline, timeout=300, prefix=network_cut())
    assert proc.returncode == 0 and proc.stdout == "" and time.time() - start < 60, proc.stderr
