"""The ``env`` stage: torch, its build, CUDA and driver versions, the GPUs, native bfloat16, every dependency's
version (a missing one fails the stage with what to install), fairseq's compiled extensions; and the one line
printed when CUDA is asked for and missing (which torch build is installed)."""
import importlib
import os
import platform
import re
import runpy
import subprocess
from importlib import metadata
from pathlib import Path

from .core import Settings, Stage

AMPERE = (8, 0)  # native bfloat16 arithmetic from compute capability 8.0 on
ROOT = Path(__file__).resolve().parents[3]
INSTALL_HINT = "bash scripts/setup_env.sh installs what is missing (with --offline DIR where there is no network)"
# fairseq's compiled extensions: training's batching, LM blocks, fairseq-generate's BLEU
EXTENSIONS = ("fairseq.data.data_utils_fast", "fairseq.data.token_block_utils_fast", "fairseq.libbleu")
OPTIONAL = {"triton": "--attention-compile's GPU kernels (torch.compile)"}


def requirements() -> list:
    """The project's runtime requirements (setup.py's ``install_requires``): from the installed metadata, or, when
    the checkout is only on the path, read from setup.py."""
    try:
        specs = [r for r in metadata.requires("fairseq_linattn") or [] if "extra ==" not in r]
    except metadata.PackageNotFoundError:
        import setuptools

        captured, real = {}, setuptools.setup
        setuptools.setup = lambda **kw: captured.update(kw)
        try:
            runpy.run_path(str(ROOT / "setup.py"))
        finally:
            setuptools.setup = real
        specs = list(captured.get("install_requires", []))
    return specs


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def import_error(name: str, modules: dict) -> str:
    """'' if the distribution ``name``'s top-level module imports, else the error in one line (a package can be
    installed and still not import, e.g. ``datasets`` against an image's older pyarrow)."""
    names = sorted(m for m in modules.get(normalized(name), ()) if not m.startswith("_"))
    try:
        importlib.import_module(names[0] if names else name.replace("-", "_"))
    except Exception as err:  # any failure to import is the finding
        return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    return ""


def dependency_rows(stage: Stage) -> None:
    """One row per requirement with its installed version: FAIL when missing, outside the required range, or
    not importable."""
    from packaging.requirements import Requirement

    modules = {}
    for module, dists in metadata.packages_distributions().items():
        for dist in dists:
            modules.setdefault(normalized(dist), set()).add(module)
    for spec in requirements():
        req = Requirement(spec)
        if req.name == "torch" or (req.marker is not None and not req.marker.evaluate()):
            continue  # torch: the first row
        try:
            version = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            stage.add(req.name, "FAIL", "missing", str(req.specifier) or "installed",
                      detail=f"pip install '{spec}'; {INSTALL_HINT}")
            continue
        problem = "" if not req.specifier or req.specifier.contains(version, prereleases=True) \
            else f"outside {req.specifier}"
        problem = problem or import_error(req.name, modules)
        stage.add(req.name, "FAIL" if problem else "INFO", version, str(req.specifier) or "—",
                  detail=f"{problem}; pip install '{spec}'" if problem else "")
    for name, why in OPTIONAL.items():
        try:
            stage.add(name, "INFO", metadata.version(name), detail=why)
        except metadata.PackageNotFoundError:
            stage.add(name, "INFO", "missing", detail=why)
    for module in EXTENSIONS:
        try:
            importlib.import_module(module)
            stage.judge(f"{module} imports", True, True, "true")
        except (ImportError, ValueError) as err:
            stage.judge(f"{module} imports", False, False, "true",
                        f"{type(err).__name__}: {err}; bash scripts/setup_env.sh builds fairseq with it")


def torch_build() -> str:
    """'CPU-only wheel 2.13.0+cpu', 'CUDA 12.4 build 2.13.0+cu124' or 'ROCm 6.1 build ...'."""
    import torch

    if torch.version.cuda:
        return f"CUDA {torch.version.cuda} build {torch.__version__}"
    if getattr(torch.version, "hip", None):
        return f"ROCm {torch.version.hip} build {torch.__version__}"
    return f"CPU-only wheel {torch.__version__}"


def no_cuda_message() -> str:
    """Why ``--device cuda`` cannot run: the installed torch build, and what to do."""
    import torch

    build = torch_build()
    if torch.version.cuda is None:
        why = (f"torch.version.cuda is None: the installed torch is a {build}; install a CUDA build of torch "
               "into .venv (docs/first_gpu_run.md)")
    else:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        why = (f"the installed torch is a {build}, but torch.cuda.is_available() is False (no GPU visible"
               + (f", CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else "")
               + f"; driver: {driver_version() or 'nvidia-smi not found'})")
    return f"gpu_selftest: no CUDA device: {why}. On a CPU-only machine: --device cpu --quick"


def driver_version() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""


def native_bf16(device: str) -> bool:
    import torch

    return device == "cpu" or torch.cuda.get_device_capability(0) >= AMPERE


def env_stage(settings: Settings) -> Stage:
    """Versions and devices; decides ``settings.bf16`` and ``settings.gpus`` for the later stages."""
    import fairseq
    import torch

    stage = Stage("env")
    stage.add("torch", "INFO", torch.__version__, detail=torch_build())
    stage.add("fairseq", "INFO", fairseq.__version__)
    stage.add("python", "INFO", platform.python_version())
    dependency_rows(stage)
    settings.bf16 = native_bf16(settings.device)
    if settings.cuda:
        settings.gpus = torch.cuda.device_count()
        stage.add("CUDA runtime", "INFO", torch.version.cuda)
        stage.add("driver", "INFO", driver_version() or "unknown (no nvidia-smi)")
        for i in range(settings.gpus):
            props = torch.cuda.get_device_properties(i)
            stage.add(f"GPU {i}", "INFO", props.name,
                      detail=f"capability {props.major}.{props.minor}, {props.total_memory / 2 ** 30:.1f} GiB")
        x = torch.ones(4, device="cuda")
        stage.judge("a CUDA kernel runs", float((x * 2).sum()) == 8.0, float((x * 2).sum()), "== 8")
    else:
        settings.gpus = 0
        stage.add("device", "INFO", "cpu", detail=f"{os.cpu_count()} cores; CUDA stages run their CPU "
                  "equivalents (fp32 instead of --fp16, gloo instead of NCCL), speed has no verdict")
        stage.judge("a CPU kernel runs", float(torch.ones(4).mul(2).sum()) == 8.0, 8.0, "== 8")
    stage.add("native bfloat16", "INFO", settings.bf16,
              detail="" if settings.bf16 else "capability < 8.0: the bfloat16 checks are skipped")
    return stage
