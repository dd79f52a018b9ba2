"""Plugin options: the registry they derive from, parse-time validation messages, their documentation."""
import subprocess
import sys
from argparse import Namespace
from dataclasses import fields

import pytest
from helpers import ROOT

from linattn.config import AttentionConfig, options_table
from linattn.methods import METHODS, layer_types, methods_for

OPTIONS = {f.name: f for f in fields(AttentionConfig)}


def options(**kw):
    return Namespace(**{**{name: f.default for name, f in OPTIONS.items()}, **kw})


@pytest.mark.parametrize("kw,message", [
    (dict(encoder_attention_type="linformer"), "--encoder-attention-type: invalid attention type 'linformer'"),
    (dict(decoder_attention_type="kernelized"), "non-causal"),
    (dict(encoder_attention_type="lln,lln"), "got 2 types"),
    (dict(cross_attention_type="lln"), "--cross-attention-type: allowed: softmax, lavo"),
    (dict(lln_chunk_size=0), "--lln-chunk-size must be an integer >= 1"),
    (dict(lln_diag_block_size=-1), "--lln-diag-block-size"),
    (dict(skyformer_landmarks=0), "--skyformer-landmarks"),
    (dict(lavo_window=0), "--lavo-window"),
    (dict(lavo_bases=0), "--lavo-bases"),
    (dict(lln_alpha=1.0), "--lln-alpha and --lln-beta must be given together"),
    (dict(lln_alpha=-1.0, lln_beta=1.0), "--lln-alpha must be > 0"),
    (dict(lln_moment_matching="off"), "needs fixed --lln-alpha"),
    (dict(lln_moment_matching="fit"), "--lln-constants-file"),
    (dict(lln_constants_file="c.json"), "read only with --lln-moment-matching fit"),
    (dict(lln_ema_momentum=1.0), "--lln-ema-momentum"),
    (dict(lln_stats="batch", decoder_attention_type="softmax,lln,lln"), "--lln-stats ema"),
    (dict(lln_stats="batch", decoder_attention_type="lln_diag"), "--lln-stats ema"),
    (dict(lln_diag_mix="sum"), "--lln-diag-mix: allowed: average, learnable_scale, learnable_ratio"),
    (dict(attention_stats_interval=-1), "--attention-stats-interval must be an integer >= 0"),
    (dict(attention_compile=True, attention_impl="looped"), "--attention-compile runs --attention-impl auto, "
     "parallel or fused, not looped"),
    (dict(attention_compile_check="always"), "--attention-compile-check: allowed: first-step, off"),
])
def test_bad_options_are_rejected_with_the_option_named(kw, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        AttentionConfig.from_args(options(**kw)).validate(encoder_layers=3, decoder_layers=3)


def test_validation_reads_the_arguments_without_changing_them():
    args = options(lln_alpha=2.0, lln_beta=3.0, lln_chunk_size=None)
    before = dict(vars(args))
    config = AttentionConfig.from_args(args)
    config.validate(decoder_layers=2)
    assert vars(args) == before
    assert config.moment_matching == "off" and config.lln_moment_matching == "paper"  # fixed alpha, beta imply off
    assert config.lln_chunk_size == 64  # None takes the default
    with pytest.raises(dataclasses_frozen_error()):
        config.lln_chunk_size = 3


def dataclasses_frozen_error():
    from dataclasses import FrozenInstanceError
    return FrozenInstanceError


def test_layer_types_expands_one_type_and_keeps_a_list():
    assert layer_types("lln", 3, "encoder") == ["lln"] * 3
    assert layer_types("softmax, lavo", 2, "decoder") == ["softmax", "lavo"]


def test_every_method_has_a_registered_module_class_with_its_roles_and_every_class_a_method():
    from fairseq_linattn.modules import ATTENTION_CLASSES, build_attention
    from fairseq_linattn.modules.base import AttentionBase
    from fairseq_linattn.modules.registry import register_attention

    assert set(ATTENTION_CLASSES) == set(METHODS)
    for name, method in METHODS.items():
        cls = ATTENTION_CLASSES[name]
        assert issubclass(cls, AttentionBase) and cls.method == name
        assert cls.__module__ == f"fairseq_linattn.modules.{name}"  # in the file named for the method
        for role in ("encoder", "decoder"):
            if role in method.roles:
                build_attention(name, 8, 2, causal=role == "decoder")
            else:
                with pytest.raises(ValueError, match=f"{role} attention type must be one of"):
                    build_attention(name, 8, 2, causal=role == "decoder")
    assert methods_for("decoder") == ["softmax", "lln", "lln_diag", "lavo"]
    with pytest.raises(ValueError, match="not a method"):
        register_attention("flash")
    with pytest.raises(ValueError, match="lln already has its module class, LLNAttention"):
        register_attention("lln")(type("Other", (AttentionBase,), {}))
    assert ATTENTION_CLASSES["lln"].__name__ == "LLNAttention"


def test_every_method_has_its_tools_entry():
    from linattn_tools.methods_extra import BENCHMARK_EXTRAS, METHODS_EXTRA, benchmarked

    assert set(METHODS_EXTRA) == set(METHODS)
    assert not set(BENCHMARK_EXTRAS) & set(METHODS)
    ops = benchmarked()
    assert list(ops) == list(METHODS) + list(BENCHMARK_EXTRAS)
    for name, method in METHODS.items():
        assert ops[name].title == METHODS_EXTRA[name].title and ops[name].flops is method.flops
        assert ops[name].causal == ("decoder" in method.roles)


def test_fairseq_dataclass_has_every_option_with_its_default_and_choices():
    from fairseq_linattn.options import AttentionOptions

    ours = {f.name: f for f in fields(AttentionOptions) if not f.name.startswith("_")}
    assert set(ours) == set(OPTIONS)
    for name, f in OPTIONS.items():
        assert ours[name].default == f.default, name
        assert ours[name].metadata["help"] == f.metadata["help"]
        if f.metadata["choices"]:
            assert {str(c) for c in ours[name].type} == set(f.metadata["choices"]), name


def test_build_attention_validates_a_mapping_of_options():
    from fairseq_linattn.modules import build_attention

    with pytest.raises(ValueError, match="--lavo-window must be an integer >= 1"):
        build_attention("lavo", 8, 2, causal=True, config={"lavo_window": 0})
    module = build_attention("lavo", 8, 2, causal=True, config={"lavo_window": 5})
    assert module.window == 5 and module.config.lln_chunk_size == 64


def test_usage_options_table_is_the_registry_s():
    usage = (ROOT / "docs" / "usage.md").read_text()
    assert options_table() in usage, "docs/usage.md's options table differs: paste `python -m " \
                                     "linattn_tools.methods_cli options-table`"


def test_methods_cli_checks_a_type_for_a_role():
    run = lambda *a: subprocess.run([sys.executable, "-m", "linattn_tools.methods_cli", *a], capture_output=True,
                                    text=True, cwd=ROOT)
    assert run("check", "--role", "decoder", "softmax,lavo").returncode == 0
    bad = run("check", "--role", "decoder", "softmax,skyformer")
    assert bad.returncode == 2 and "--decoder-attention-type" in bad.stderr and "allowed: softmax, lln" in bad.stderr
    assert run("list", "--role", "cross").stdout.split() == methods_for("cross")


def test_linattn_lm_s_own_architecture_validates_when_its_model_is_built():
    # --arch linattn_lm has no plugin architecture function: build_model is where its options are checked
    from fairseq_linattn.models.linattn_lm import LinAttnLanguageModel

    args = options(arch="linattn_lm", decoder_layers=2, decoder_attention_type="skyformer")
    with pytest.raises(ValueError, match="non-causal"):
        LinAttnLanguageModel.build_model(args, task=None)


def test_per_layer_types_are_checked_against_the_model_s_layer_counts():
    from fairseq_linattn.options import check_attention_options

    with pytest.raises(ValueError, match="got 3 types .* for 2 layers"):
        check_attention_options(options(encoder_attention_type="softmax,lln,lln"), encoder_layers=2)
    with pytest.raises(ValueError, match="got 2 types .* for 3 layers"):
        check_attention_options(options(decoder_attention_type="softmax,lln"), decoder_layers=3)
    assert check_attention_options(options(encoder_attention_type="softmax,lln"), encoder_layers=2)
