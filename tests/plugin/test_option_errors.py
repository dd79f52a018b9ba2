"""Errors a user can act on: a bad plugin option ends a fairseq command line as argparse ends a bad choice (usage,
one ``prog: error: ...`` line, exit 2), and so does an ``--attention-impl`` the run's attention cannot take, with
the reasons; a fairseq without its compiled extensions says so in one line before any data is loaded; the
self-test's env stage lists every dependency's version and fails on a missing one."""
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest
from fairseq import options
from helpers import ROOT

import fairseq_linattn  # noqa: F401  (registers the models, wraps parse_args_and_arch)
from fairseq_linattn.options import AttentionOptionError, check_attention_options, missing_extension
from linattn.ops import impls
from linattn_tools.recipes.selftest import env
from linattn_tools.recipes.selftest.core import Stage

USER_DIR = str(ROOT / "fairseq_linattn")


def parse(capsys, *argv):
    """fairseq-train's parsing of ``argv`` in this process: (exit status, stderr lines)."""
    parser = options.get_training_parser()
    with pytest.raises(SystemExit) as stop:
        options.parse_args_and_arch(parser, ["/nonexistent/data", "--user-dir", USER_DIR, "--cpu", *argv])
    return stop.value.code, capsys.readouterr().err.rstrip("\n").splitlines()


@pytest.mark.parametrize("argv,message", [
    (["--arch", "linattn_lm_tiny", "--task", "language_modeling", "--lln-chunk-size", "0"],
     "--lln-chunk-size must be an integer >= 1, got 0"),
    (["--arch", "linattn_lm_tiny", "--task", "language_modeling", "--decoder-attention-type", "skyformer"],
     "--decoder-attention-type: invalid attention type 'skyformer'"),
    # the dataclass model's own architecture: validated at parse time too, with its default 6 layers
    (["--arch", "linattn_lm", "--task", "language_modeling", "--decoder-attention-type", "lln,lln"],
     "got 2 types (lln,lln) for 6 layers"),
    (["--arch", "linattn_roberta_tiny", "--task", "masked_lm", "--encoder-attention-type", "lln,lln,lln"],
     "got 3 types"),
])
def test_a_bad_option_ends_parsing_as_argparse_does(capsys, argv, message):
    code, lines = parse(capsys, *argv)
    assert code == 2
    assert lines[0].startswith("usage: ") and lines[-1].startswith(f"{Path(sys.argv[0]).name}: error: ")
    assert message in lines[-1] and "Traceback" not in "\n".join(lines)
    # the same shape as argparse's own error for a bad choice of a plugin option
    code, argparse_lines = parse(capsys, "--arch", "linattn_lm_tiny", "--task", "language_modeling",
                                 "--attention-impl", "gpu")
    assert code == 2 and argparse_lines[0] == lines[0]
    assert "error: argument --attention-impl: invalid choice: 'gpu' (choose from 'auto', " in argparse_lines[-1]


LM = ("--arch", "linattn_lm_tiny", "--task", "language_modeling")
NO_HALF = "(float32 on cpu: no --fp16, --bf16 or --amp; --cpu): lln decoder self-attention: dtype torch.float32 not in"
ALLOWED = "; allowed here: auto, parallel, looped"


def test_fused_without_half_precision_ends_parsing_naming_the_reasons(capsys):
    code, lines = parse(capsys, *LM, "--decoder-attention-type", "softmax,lln", "--attention-impl", "fused")
    assert code == 2 and lines[0].startswith("usage: ")
    assert lines[-1].endswith(f": error: --attention-impl fused cannot run this run's attention {NO_HALF} "
                              f"(float16, bfloat16){ALLOWED}")
    code, lines = parse(capsys, *LM, "--decoder-attention-type", "lln", "--attention-impl", "fused", "--fp16",
                        "--decoder-embed-dim", "512", "--decoder-attention-heads", "2")
    assert code == 2 and lines[-1].endswith("(float16 on cpu: --fp16; --cpu): lln decoder self-attention: head dim "
                                            f"256 > 128 (held in registers){ALLOWED}")


def train_args(*argv):
    """fairseq-train's arguments for ``argv`` (parsed in this process, no data read)."""
    return options.parse_args_and_arch(options.get_training_parser(),
                                       ["/nonexistent/data", "--user-dir", USER_DIR, *LM, *argv])


@pytest.mark.parametrize("argv", [("--fp16",), ("--bf16",), ("--amp",)])
def test_fused_in_half_precision_is_accepted(argv):
    """On the CPU under Triton's interpreter (tests/conftest.py), as the tests run the kernels; --amp gives the ops
    float16 q, k, v (autocast's projections)."""
    args = train_args("--cpu", "--decoder-attention-type", "lln", "--attention-impl", "fused", *argv)
    assert args.attention_impl == "fused"


def test_amp_keeps_the_parameters_float32_which_lavo_kernels_refuse(capsys):
    code, lines = parse(capsys, *LM, "--decoder-attention-type", "lavo", "--attention-impl", "fused", "--amp")
    assert code == 2 and lines[-1].endswith("(float16 on cpu: --amp: float16 projections, float32 parameters; --cpu): "
                                            "lavo decoder self-attention: bases' dtype torch.float32 is not the "
                                            f"queries' torch.float16{ALLOWED}")
    assert train_args("--cpu", "--decoder-attention-type", "lavo", "--attention-impl", "fused", "--fp16")


def test_fused_names_a_missing_triton_and_the_cpu_without_the_interpreter(capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr(impls, "triton_available", lambda: False)
    code, lines = parse(capsys, *LM, "--decoder-attention-type", "lln", "--attention-impl", "fused", "--bf16")
    assert code == 2 and lines[-1].endswith(
        "(bfloat16 on cpu: --bf16; --cpu): lln decoder self-attention: Triton is not installed; device cpu: the "
        f"fused kernels run on cuda (cpu only under TRITON_INTERPRET=1){ALLOWED}")
    # a method without fused kernels runs parallel; arguments without the trainer's options are not checked here
    assert train_args("--cpu", "--decoder-attention-type", "softmax", "--attention-impl", "fused")
    assert check_attention_options(Namespace(decoder_attention_type="lln", attention_impl="fused"), decoder_layers=2)


def test_from_python_a_bad_option_is_still_a_value_error():
    args = Namespace(decoder_attention_type="skyformer")
    with pytest.raises(ValueError, match="non-causal") as err:
        check_attention_options(args, decoder_layers=2)
    assert isinstance(err.value, AttentionOptionError)


def test_the_command_line_exits_2_with_one_error_line():
    proc = subprocess.run([sys.executable, "-m", "fairseq_cli.train", "/nonexistent/data", "--user-dir", USER_DIR,
                           "--task", "language_modeling", "--arch", "linattn_lm_tiny", "--cpu",
                           "--decoder-attention-type", "skyformer"], capture_output=True, text=True, timeout=300)
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert errors == [proc.stderr.rstrip("\n").splitlines()[-1]] and errors[0].startswith("train.py: error: ")


def test_a_missing_extension_stops_the_command_line_in_one_line(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "fairseq.data.data_utils_fast", None)  # as if fairseq was built without it
    code, lines = parse(capsys, "--arch", "linattn_lm_tiny", "--task", "language_modeling")
    assert code == 1 and len(lines) == 1
    assert lines[0].startswith(f"{Path(sys.argv[0]).name}: error: fairseq's compiled extension "
                               "fairseq.data.data_utils_fast (batching) does not import")
    assert "bash scripts/setup_env.sh" in lines[0]


def test_libbleu_is_needed_only_for_bleu_scoring(monkeypatch):
    assert missing_extension(Namespace(scoring="bleu")) is None
    monkeypatch.setitem(sys.modules, "fairseq.libbleu", None)
    assert missing_extension(Namespace(scoring="sacrebleu")) is None
    assert "fairseq.libbleu (--scoring bleu)" in missing_extension(Namespace(scoring="bleu"))


def test_env_stage_lists_every_dependency_and_fails_on_a_missing_one(monkeypatch):
    stage = Stage("env")
    env.dependency_rows(stage)
    rows = {r.check: r for r in stage.rows}
    for name in ("numpy", "hydra-core", "omegaconf", "datasets", "sentencepiece", "tensorboard", "triton"):
        assert name in rows, name
    assert rows["hydra-core"].status == "INFO" and rows["hydra-core"].measured == "1.3.2"
    assert rows["fairseq.data.data_utils_fast imports"].status == "PASS"

    monkeypatch.setattr(env, "requirements", lambda: ["numpy", "no-such-dependency-xyz>=1", "numpy<0.1",
                                                      "sentencepiece"])
    monkeypatch.setitem(sys.modules, "sentencepiece", None)  # installed, but its import fails
    monkeypatch.setitem(sys.modules, "fairseq.data.token_block_utils_fast", None)
    stage = Stage("env")
    env.dependency_rows(stage)
    statuses = [(r.check, r.status) for r in stage.rows]
    assert statuses[:4] == [("numpy", "INFO"), ("no-such-dependency-xyz", "FAIL"), ("numpy", "FAIL"),
                            ("sentencepiece", "FAIL")]
    assert "pip install 'no-such-dependency-xyz>=1'" in stage.rows[1].detail and stage.rows[1].measured == "missing"
    assert "outside <0.1" in stage.rows[2].detail and "import of sentencepiece halted" in stage.rows[3].detail
    assert ("fairseq.data.token_block_utils_fast imports", "FAIL") in statuses


def test_env_stage_reads_setup_py_when_the_project_is_not_installed(monkeypatch):
    from packaging.requirements import Requirement

    assert "datasets" in {Requirement(r).name for r in env.requirements()}  # from the installed metadata

    def not_installed(name):
        raise env.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(env.metadata, "requires", not_installed)
    from_setup_py = {str(Requirement(r)) for r in env.requirements()}
    assert {"datasets", "sentencepiece", "hydra-core==1.3.2"} <= from_setup_py
    assert "pytest" not in from_setup_py  # the test extra is no runtime need
