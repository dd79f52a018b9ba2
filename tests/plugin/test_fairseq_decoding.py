"""Decoding padded batches through fairseq's own decoders (in process): incremental == full forward on
every real token, beam reordering after a padded prefix, and LAVO cross-attention reading its source
once per source in fairseq's beam search."""
import pytest
import torch
from fairseq import options, tasks
from fairseq.data import Dictionary
from fairseq.sequence_generator import SequenceGenerator
from fairseq_data import USER_DIR
from helpers import rel_err

from linattn.methods import methods_for
from linattn_tools.recipes.selftest import decode as selftest_decode

# small windows, blocks and chunks so that 16 tokens cross several; LLN's alpha != beta
METHOD_ARGS = ["--lln-chunk-size", "4", "--lln-diag-block-size", "4", "--lavo-window", "4",
               "--lln-diag-mix", "learnable_scale", "--lln-stats-per-head"]
CAUSAL = methods_for("decoder")


def write_dicts(root, names) -> None:
    d = Dictionary()
    for i in range(40):
        d.add_symbol(f"w{i}")
    for name in names:
        d.save(str(root / name))


def build(argv):
    args = options.parse_args_and_arch(options.get_training_parser(), [*argv, "--user-dir", USER_DIR, "--cpu"])
    task = tasks.setup_task(args)
    return task, task.build_model(args)


def spread_parameters(model, gen) -> None:
    """Make what starts at a constant differ: LAVO biases, LLN+Diag mixes, LLN's EMA statistics (per head,
    queries apart from keys, so alpha != beta)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("pos_bias", "mix_r", "mix_p")):
                p.copy_(torch.rand(p.shape, generator=gen) + 0.2)
        for name, b in model.named_buffers():  # disjoint ranges: alpha / beta = sigma_k / sigma_q >= 1.26
            if name.endswith("ema_var_q"):
                b.copy_(torch.rand(b.shape, generator=gen) * 0.7 + 0.3)
            elif name.endswith("ema_var_k"):
                b.copy_(torch.rand(b.shape, generator=gen) * 1.4 + 1.6)


def padded_tokens(task, gen, batch=3, t=16):
    """Row 0 left-padded, row 1 right-padded, row 2 padded on both sides and in the middle (the self-test's rows)."""
    return selftest_decode.padded_tokens(task.target_dictionary, gen, batch, t)


def decode(decoder, tokens, order=None, switch_at=0, **kw):
    """fairseq's incremental loop (the decoder reads only the last column); beams reordered at ``switch_at``.
    Returns the outputs (B, T - switch_at, V) from the switch on."""
    state, outs = {}, []
    for t in range(tokens.shape[1]):
        if t == switch_at and order is not None:
            decoder.reorder_incremental_state_scripting(state, order)
            tokens, outs = tokens[order], []
            kw = {k: v if k != "encoder_out" else decoder_encoder_out_reorder(v, order) for k, v in kw.items()}
        outs.append(decoder(tokens[:, : t + 1], incremental_state=state, **kw)[0])
    return torch.cat(outs, 1)


def decoder_encoder_out_reorder(encoder_out, order):
    return {k: [x.index_select(1 if k in ("encoder_out", "encoder_embedding_t") else 0, order) for x in v]
            if k in ("encoder_out", "encoder_padding_mask") else v for k, v in encoder_out.items()}


@pytest.fixture
def lm(tmp_path):
    write_dicts(tmp_path, ["dict.txt"])

    def make(method, gen):
        torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
        task, model = build([str(tmp_path), "--task", "language_modeling", "--arch", "linattn_lm_tiny",
                             "--decoder-attention-type", method, "--no-token-positional-embeddings", *METHOD_ARGS])
        spread_parameters(model, gen)
        return task, model.eval()
    return make


@pytest.mark.parametrize("method", CAUSAL)
def test_lm_decoder_decodes_a_padded_batch_like_its_full_forward(lm, gen, method):
    task, model = lm(method, gen)
    tokens = padded_tokens(task, gen)
    with torch.no_grad():
        full = model.decoder(tokens)[0]
        inc = decode(model.decoder, tokens)
    real = tokens.ne(task.target_dictionary.pad())
    assert rel_err(inc[real], full[real]) < 1e-5


@pytest.mark.parametrize("method", CAUSAL)
def test_lm_decoder_beam_reordering_after_a_padded_prefix(lm, gen, method):
    task, model = lm(method, gen)
    tokens = padded_tokens(task, gen)
    order, switch = torch.tensor([2, 0, 1, 2, 1]), 9  # reorder and expand, as beam search does
    with torch.no_grad():
        full = model.decoder(tokens[order])[0][:, switch:]
        inc = decode(model.decoder, tokens, order, switch)
    real = tokens[order][:, switch:].ne(task.target_dictionary.pad())
    assert rel_err(inc[real], full[real]) < 1e-5


@pytest.fixture
def translation(tmp_path):
    write_dicts(tmp_path, ["dict.src.txt", "dict.tgt.txt"])

    def make(gen, decoder_type="lavo"):
        torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
        task, model = build([str(tmp_path), "--task", "translation", "--source-lang", "src", "--target-lang", "tgt",
                             "--arch", "linattn_transformer_tiny", "--encoder-attention-type", "lln",
                             "--decoder-attention-type", decoder_type, "--cross-attention-type", "lavo",
                             "--no-token-positional-embeddings", *METHOD_ARGS])
        spread_parameters(model, gen)
        return task, model.eval()
    return make


def source(task, gen, batch=3, s=12):
    """Left-padded sources, as fairseq's translation task collates them."""
    d = task.source_dictionary
    src = torch.randint(d.nspecial, len(d), (batch, s), generator=gen)
    src[:, -1] = d.eos()
    src[1, :5] = src[2, :2] = d.pad()
    return src, src.ne(d.pad()).sum(1)


def cross_attention_projections(model):
    calls = {"k_proj": 0, "v_proj": 0}
    for layer in model.decoder.layers:
        for name in calls:
            getattr(layer.encoder_attn, name).register_forward_hook(
                lambda *_, name=name: calls.__setitem__(name, calls[name] + 1))
    return calls


@pytest.mark.parametrize("decoder_type", ["lavo", "lln"])
def test_encoder_decoder_with_lavo_cross_attention_decodes_like_its_full_forward(translation, gen, decoder_type):
    """Padded target prefix, left-padded source, beams reordered mid-way: the cached source memory
    gives the full forward's outputs, and the source is projected once per layer over the whole decode."""
    task, model = translation(gen, decoder_type)
    src, lengths = source(task, gen)
    tgt = padded_tokens(task, gen, t=10)
    order, switch = torch.tensor([1, 1, 0, 2]), 5
    with torch.no_grad():
        enc = model.encoder(src, src_lengths=lengths)
        full = model.decoder(tgt, encoder_out=enc)[0]
        calls = cross_attention_projections(model)
        inc = decode(model.decoder, tgt, encoder_out=enc)
        assert calls == {"k_proj": 0, "v_proj": len(model.decoder.layers)}
        full_beams = model.decoder(tgt[order], encoder_out=decoder_encoder_out_reorder(enc, order))[0][:, switch:]
        inc_beams = decode(model.decoder, tgt, order, switch, encoder_out=enc)
    real = tgt.ne(task.target_dictionary.pad())
    assert rel_err(inc[real], full[real]) < 1e-5
    real = tgt[order][:, switch:].ne(task.target_dictionary.pad())
    assert rel_err(inc_beams[real], full_beams[real]) < 1e-5


def test_beam_search_projects_the_lavo_cross_attention_source_once(translation, gen):
    """fairseq's SequenceGenerator (beam 4, sentences finishing at different steps): one value projection
    of the source per cross-attention layer for the whole search."""
    task, model = translation(gen)
    src, lengths = source(task, gen)
    calls = cross_attention_projections(model)
    generator = SequenceGenerator([model], task.target_dictionary, beam_size=4, max_len_b=12, min_len=2)
    with torch.no_grad():
        hypos = generator.forward({"net_input": {"src_tokens": src, "src_lengths": lengths}})
    assert len(hypos) == 3 and all(len(h) == 4 for h in hypos)
    assert calls == {"k_proj": 0, "v_proj": len(model.decoder.layers)}


def test_every_layer_of_an_encoder_decoder_gets_the_attention_its_options_name(translation, gen):
    from fairseq_linattn.modules import ATTENTION_CLASSES

    _, model = translation(gen, decoder_type="lln_diag")
    assert all(type(layer.self_attn) is ATTENTION_CLASSES["lln"] for layer in model.encoder.layers)
    for layer in model.decoder.layers:
        assert type(layer.self_attn) is ATTENTION_CLASSES["lln_diag"] and layer.self_attn.causal
        assert type(layer.encoder_attn) is ATTENTION_CLASSES["lavo"] and layer.encoder_attn.cross
