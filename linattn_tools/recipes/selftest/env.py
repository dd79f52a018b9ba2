"""The ``env`` stage: torch, its build, CUDA and driver versions, the GPUs, native bfloat16; and the one line
printed when CUDA is asked for and missing (which torch build is installed)."""
import os
import platform
import subprocess

from .core import Settings, Stage

AMPERE = (8, 0)  # native bfloat16 arithmetic from compute capability 8.0 on


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
