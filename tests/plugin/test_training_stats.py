"""Training-time concentration logging (--attention-stats-interval): schedule, values, side effects."""
import pytest
import torch

from fairseq_linattn.analysis.module_matrix import module_attention_matrix
from fairseq_linattn.analysis.training_stats import (
    RECORDER_NAME,
    collect_attention_stats,
    install_attention_stats,
    layer_label,
)
from linattn.analysis import entropy, spectral_gap

VOCAB = 40


def build_lm(tmp_path, attention="softmax,lln", *extra):
    from fairseq import options, tasks

    (tmp_path / "dict.txt").write_text("".join(f"w{i} 1\n" for i in range(VOCAB)))
    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, [str(tmp_path), "--task", "language_modeling", "--arch",
                                                "linattn_lm_tiny", "--decoder-attention-type", attention,
                                                "--tokens-per-sample", "64", "--cpu", "--dropout", "0", *extra])
    task = tasks.setup_task(args)
    return task, task.build_model(args)


def tokens(gen, batch=3, length=20):
    t = torch.randint(4, VOCAB, (batch, length), generator=gen)
    t[1:, -5:] = 1  # right padding (fairseq's pad index) on the later sequences
    return t


class StubOptimizer:
    def backward(self, loss):
        loss.backward()


def run_updates(task, model, gen, updates, batch=None):
    from fairseq.criterions.cross_entropy import CrossEntropyCriterion

    criterion = CrossEntropyCriterion(task, sentence_avg=False)
    seen = []
    for n in updates:
        src = tokens(gen) if batch is None else batch
        sample = {"net_input": {"src_tokens": src, "src_lengths": (src != 1).sum(1)},
                  "target": src.roll(-1, 1), "ntokens": int((src != 1).sum())}
        # calls model.set_num_updates(n); the plugin's metrics hook collects the stats into the logging output
        _, _, log = task.train_step(sample, model, criterion, StubOptimizer(), update_num=n)
        seen.append({key[len("linattn_"):-len("_sum")]: value for key, value in log.items()
                     if key.startswith("linattn_attn_") and key.endswith("_sum")})
    return seen


def test_records_every_k_updates_through_fairseq_train_step(tmp_path, gen):
    task, model = build_lm(tmp_path)
    recorder = install_attention_stats(model, 3)
    assert recorder is not None and not list(recorder.parameters()) and not list(recorder.buffers())
    seen = run_updates(task, model, gen, range(7))
    assert [bool(s) for s in seen] == [True, False, False, True, False, False, True]
    expected = {f"attn_dec0_{m}" for m in ("entropy", "spectral_gap")} | {
        f"attn_dec1_{m}" for m in ("entropy", "spectral_gap", "alpha", "beta", "tau")}
    assert set(seen[0]) == expected
    assert all(isinstance(v, float) for v in seen[0].values())
    assert collect_attention_stats(model) == {}  # collected once
    model.eval()  # validation forwards record nothing
    model.set_num_updates(9)
    with torch.no_grad():
        model(tokens(gen))
    assert collect_attention_stats(model) == {}


def test_recorded_values_are_the_measures_of_the_first_sequence(tmp_path, gen):
    task, model = build_lm(tmp_path)
    install_attention_stats(model, 1, rows=32, chain_tokens=64)  # a 20-token sequence is measured exactly
    inputs = {}
    for name, module in model.named_modules():
        if name.endswith("self_attn"):
            module.register_forward_hook(
                lambda m, a, kw, out, name=name: inputs.__setitem__(name, (kw["query"].detach(), m)), with_kwargs=True)
    batch = tokens(gen)
    stats = run_updates(task, model, gen, [5], batch=batch)[0]
    for layer in (0, 1):
        query, module = inputs[f"decoder.layers.{layer}.self_attn"]
        lln = module.matcher if hasattr(module, "matcher") else None
        if lln is not None:  # the matcher's values of that very forward
            assert stats["attn_dec1_alpha"] == pytest.approx(lln.last_alpha.mean().item(), rel=1e-9)
            assert stats["attn_dec1_tau"] == pytest.approx(lln.last_tau.mean().item(), rel=1e-9)
            module.eval()  # the EMA of the next forward differs from this one's: rebuild with its values
            lln.ema_var_q.copy_(lln.last_sigma_q ** 2)
            lln.ema_var_k.copy_(lln.last_sigma_k ** 2)
        P = module_attention_matrix(module, query[:, :1])[0]  # sequence 0 has no padding
        assert stats[f"attn_dec{layer}_entropy"] == pytest.approx(entropy(P).mean().item(), rel=1e-4)
        assert stats[f"attn_dec{layer}_spectral_gap"] == pytest.approx(spectral_gap(P).mean().item(), rel=1e-4)


def test_hooks_change_neither_outputs_nor_gradients(tmp_path, gen):
    task, model = build_lm(tmp_path, "lln_diag,lavo")
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    batch = tokens(gen)

    def loss_and_grads():
        model.load_state_dict(reference)
        model.zero_grad()
        model.train()
        model.set_num_updates(0)
        out = model(batch)[0]
        out.float().logsumexp(-1).sum().backward()
        return out.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    out0, grads0 = loss_and_grads()
    install_attention_stats(model, 1)
    out1, grads1 = loss_and_grads()
    assert set(collect_attention_stats(model)) >= {"attn_dec0_entropy", "attn_dec1_spectral_gap", "attn_dec0_alpha"}
    assert torch.equal(out0, out1) and all(torch.equal(a, b) for a, b in zip(grads0, grads1))
    assert set(model.state_dict()) == set(reference)  # checkpoints are unchanged


def test_a_model_built_with_an_interval_gets_the_recorder_and_without_one_none(tmp_path):
    (tmp_path / "on").mkdir()
    (tmp_path / "off").mkdir()
    _, model = build_lm(tmp_path / "on", "lln", "--attention-stats-interval", "3")
    assert hasattr(model, RECORDER_NAME)
    _, model = build_lm(tmp_path / "off", "lln")
    assert not hasattr(model, RECORDER_NAME)


def test_interval_zero_installs_nothing_and_bad_values_are_rejected(tmp_path):
    _, model = build_lm(tmp_path, "lln")
    before = len(list(model.modules()))
    assert install_attention_stats(model, 0) is None and len(list(model.modules())) == before
    assert collect_attention_stats(model) == {}
    with pytest.raises(ValueError, match="--attention-stats-interval"):
        install_attention_stats(model, -1)
    install_attention_stats(model, 5)
    with pytest.raises(ValueError, match="already installed"):
        install_attention_stats(model, 5)


def test_layer_labels_follow_fairseq_module_names():
    assert layer_label("decoder.layers.3.self_attn", 0) == "dec3"
    assert layer_label("encoder.sentence_encoder.layers.11.self_attn", 0) == "enc11"
    assert layer_label("decoder.layers.2._checkpoint_wrapped_module.self_attn", 0) == "dec2"
    assert layer_label("attn", 4) == "layer4"
