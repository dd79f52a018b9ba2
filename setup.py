"""fairseq_linattn: linear-complexity self-attention for fairseq (LLN, LLN+Diag, Skyformer, LAVO).

fairseq itself comes from the sdist of ``fairseq-fixed==0.12.3.1`` (upstream fairseq 0.12 packaged for Python
3.11+). It is *not* listed in ``install_requires``: its metadata asks for torchaudio, which would pull a multi-GB
CUDA torch. ``scripts/setup_env.sh`` builds it for the Python in use (``scripts/fairseq_build.py``) and installs it
without dependencies; the list below carries fairseq's real runtime needs. ``scripts/wheelhouse.py`` reads these
lists (``setup`` caught) to fill a wheelhouse for machines without a network.
"""
from setuptools import find_packages, setup

FAIRSEQ_REQUIREMENT = "fairseq-fixed==0.12.3.1"  # installed by scripts/setup_env.sh

FAIRSEQ_RUNTIME_DEPS = [
    "hydra-core==1.3.2",
    "omegaconf==2.3.0",
    "bitarray",
    "sacrebleu",
    "regex",
    "scikit-learn",
    "scipy",
    "cffi",
    "tqdm",
    "packaging",
    "cython",
    "requests",  # fairseq downloads the GPT-2 BPE files with it
]

setup(
    name="fairseq_linattn",
    version="0.1.0",
    description="Linear-complexity attention (LLN, LLN+Diag, Skyformer, LAVO) as a fairseq plugin",
    packages=find_packages(include=["linattn", "linattn.*", "fairseq_linattn", "fairseq_linattn.*",
                                    "linattn_tools", "linattn_tools.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.0",  # satisfied by an installed torch (CPU 2.13.0 here, or the user's CUDA build)
        "numpy",
        *FAIRSEQ_RUNTIME_DEPS,
        "sentencepiece",
        "datasets",
        "tensorboard",
        # fairseq's text_to_speech task, imported by every fairseq command before the plugin, logs "Please install
        # tensorboardX" when it is missing, although --tensorboard-logdir writes through torch.utils.tensorboard
        "tensorboardX",
        "matplotlib",
        "pyyaml",  # configs/*.yaml (linattn_tools.recipes.config)
    ],
    # Triton: its interpreter runs the fused kernels' tests on the CPU (3.9.0; they skip below 3.9, whose interpreter
    # cannot take a runtime loop bound); compiled, the kernels ran on an H100 with 3.6.0, which torch 2.11's CUDA wheels
    # ship. A lower bound only, so that a CUDA torch keeps the Triton it requires
    extras_require={"test": ["pytest", "pytest-timeout", "pytest-xdist", "ruff==0.17.6",
                             'triton>=3.6; platform_system == "Linux"']},
)
