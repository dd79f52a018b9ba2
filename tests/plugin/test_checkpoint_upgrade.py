"""Loading a stock fairseq (softmax) checkpoint into plugin attention, in seconds: a state dict with the old key
names (``decoder.layers.<i>.self_attn.{q,k,v,out}_proj.*`` only) goes through fairseq's strict load, where each
module's ``upgrade_state_dict_named`` adds its own parameters and buffers (LAVO's bases and bias, LLN+Diag's mix
weights, LLN's EMA statistics) at their initial values and keeps every stock tensor."""
from types import SimpleNamespace

import pytest
import torch
from fairseq import models, options
from fairseq.data import Dictionary

import fairseq_linattn  # noqa: F401  (registers the plugin's models)
from fairseq_linattn.modules import build_attention
from linattn.methods import METHODS

E, H = 16, 2
CONFIG = dict(lln_stats="ema", lln_diag_mix="learnable_ratio", lavo_window=4)


def _lm(arch: str, *extra: str):
    """A 3-layer LM of width 16 over a 6-word dictionary, built in-process (no data on disk)."""
    vocab = Dictionary()
    for word in "abcdef":
        vocab.add_symbol(word)
    args = options.parse_args_and_arch(options.get_training_parser(), [
        "DATA", "--task", "language_modeling", "--arch", arch, "--decoder-layers", "3", "--decoder-embed-dim",
        str(E), "--decoder-ffn-embed-dim", "32", "--decoder-attention-heads", str(H), "--dropout", "0", *extra])
    return models.build_model(args, SimpleNamespace(source_dictionary=vocab, target_dictionary=vocab)).eval()


def _plugin_lm():
    return _lm("linattn_lm", "--decoder-attention-type", "lln,lln_diag,lavo", "--lln-stats", "ema",
               "--lln-diag-mix", "learnable_ratio", "--lavo-window", "4")


def test_stock_lm_state_dict_loads_into_plugin_attention():
    torch.manual_seed(0)
    stock = _lm("transformer_lm").state_dict()
    assert not any(".self_attn." in key and "_proj." not in key for key in stock)  # the old key names only
    model = _plugin_lm()
    fresh = {key: value.clone() for key, value in model.state_dict().items()}
    added = set(fresh) - set(stock)
    assert {key.rsplit(".", 1)[-1] for key in added} == {"ema_var_q", "ema_var_k", "mix_r", "bases", "pos_bias"}
    model.load_state_dict({key: value.clone() for key, value in stock.items()}, strict=True)
    loaded = model.state_dict()
    for key, value in stock.items():
        assert torch.equal(loaded[key], value), key
    for key in added:  # started from their initial values
        assert torch.equal(loaded[key], fresh[key]), key
    out, _ = model(torch.tensor([[4, 5, 6, 7, 8, 2]]))
    assert torch.isfinite(out).all()


def test_upgrade_keeps_the_plugin_parameters_a_checkpoint_has():
    torch.manual_seed(0)
    trained = {key: value + 0.5 for key, value in _plugin_lm().state_dict().items()}  # none at its initial value
    model = _plugin_lm()
    model.load_state_dict({key: value.clone() for key, value in trained.items()}, strict=True)
    for key, value in model.state_dict().items():
        assert torch.equal(value, trained[key]), key


@pytest.mark.parametrize("method,causal", [(m, c) for m in METHODS for c in (False, True)
                                           if ("decoder" if c else "encoder") in METHODS[m].roles])
def test_each_module_upgrades_a_stock_attention_state_dict(method, causal):
    module = build_attention(method, E, H, causal=causal, config=CONFIG)
    prefix = "encoder.sentence_encoder.layers.1.self_attn"
    stock = {f"{prefix}.{proj}_proj.{p}": torch.randn(E, E) if p == "weight" else torch.randn(E)
             for proj in ("q", "k", "v", "out") for p in ("weight", "bias")}
    state = {"encoder.embed_tokens.weight": torch.randn(6, E), **stock}
    module.upgrade_state_dict_named(state, prefix)
    own = module.state_dict()
    assert set(state) == {"encoder.embed_tokens.weight", *(f"{prefix}.{key}" for key in own)}
    for key, value in own.items():
        full = f"{prefix}.{key}"
        assert torch.equal(state[full], stock[full] if full in stock else value), key
    module.load_state_dict({key: state[f"{prefix}.{key}"] for key in own}, strict=True)


def test_a_module_absent_from_the_checkpoint_is_left_out():
    module = build_attention("lavo", E, H, causal=True, config=CONFIG)
    state = {"decoder.layers.0.self_attn.q_proj.weight": torch.randn(E, E)}
    module.upgrade_state_dict_named(state, "decoder.layers.1.self_attn")  # a layer the checkpoint lacks
    assert list(state) == ["decoder.layers.0.self_attn.q_proj.weight"]
