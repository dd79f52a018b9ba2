"""Plugin options: parse-time validation messages, and documentation of every option."""
from argparse import Namespace
from dataclasses import fields
from pathlib import Path

import pytest

from fairseq_linattn.modules.options import AttentionOptions, layer_types, validate_attention_options


def options(**kw):
    args = Namespace(**{f.name: f.default for f in fields(AttentionOptions) if not f.name.startswith("_")})
    for key, value in kw.items():
        setattr(args, key, value)
    return args


@pytest.mark.parametrize("kw,message", [
    (dict(encoder_attention_type="linformer"), "--encoder-attention-type: invalid attention type 'linformer'"),
    (dict(decoder_attention_type="kernelized"), "non-causal"),
    (dict(encoder_attention_type="lln,lln"), "got 2 types"),
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
])
def test_bad_options_are_rejected_with_the_option_named(kw, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate_attention_options(options(**kw), encoder_layers=3, decoder_layers=3)


def test_fixed_alpha_beta_turn_moment_matching_off():
    args = options(lln_alpha=2.0, lln_beta=2.0)
    validate_attention_options(args, decoder_layers=2)
    assert args.lln_moment_matching == "off"


def test_layer_types_expands_one_type_and_keeps_a_list():
    assert layer_types("lln", 3, "encoder_attention_type") == ["lln"] * 3
    assert layer_types("softmax, lavo", 2, "decoder_attention_type") == ["softmax", "lavo"]


def test_readme_documents_every_option():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    missing = [f.name for f in fields(AttentionOptions)
               if not f.name.startswith("_") and f"`--{f.name.replace('_', '-')}`" not in readme]
    assert not missing, f"README lacks {missing}"
