"""Eval never depends on the batch: a sequence's output in a padded batch equals its output alone, unpadded, for
every method and role, and a sentence classifier's accuracy and loss do not depend on --batch-size."""
import pytest
import torch

from fairseq_linattn.modules import build_attention
from linattn.methods import METHODS

E, H = 32, 4
LENGTHS = (9, 14, 3, 14, 1)  # a neighbour of the same length, longer ones, shorter ones, a single token
CONFIG = {"lln_chunk_size": 4, "lln_diag_block_size": 4, "lavo_window": 4, "skyformer_landmarks": 6,
          "lln_stats_per_head": True}
LEARNS = ("lln", "lln_diag")  # their moment matching folds training batches into the statistics eval reads
CASES = [(name, role, state) for name, m in METHODS.items() for role in m.roles
         for state in (("fresh", "trained") if name in LEARNS else ("fresh",))]


def build(method, role, gen, stats):
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
    config = {**CONFIG, "lln_stats": stats} if stats != "auto" else CONFIG
    return build_attention(method, E, H, causal=role == "decoder", cross=role == "cross", config=config).double()


def pad(seqs, side):
    """Sequences (n_i, E) -> (T, B, E), fairseq's time-first layout, padded on ``side`` with noise, and its mask."""
    t = max(len(s) for s in seqs)
    x = torch.randn(t, len(seqs), E, dtype=torch.float64)
    mask = torch.ones(len(seqs), t, dtype=torch.bool)
    for b, s in enumerate(seqs):
        at = slice(t - len(s), t) if side == "left" else slice(0, len(s))
        x[at, b], mask[b, at] = s, False
    return x, mask


def real(out, mask, b):
    return out[~mask[b], b]


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("method, role, state", CASES)
def test_eval_output_of_a_sequence_does_not_depend_on_its_batch(method, role, state, side, gen):
    """Tolerance: 1e-12 absolute on outputs of size about 1 (float64 rounding; a batch dependence of LLN's
    moment statistics gives about 1e-3)."""
    module = build(method, role, gen, "auto")
    if state == "trained":
        x = torch.randn(11, 3, E, dtype=torch.float64, generator=gen)
        for _ in range(2):  # training forwards fold their statistics into the running ones eval reads
            module.train()(x, x, x)[0].sum().backward()
    module.eval()
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
    seqs = [torch.randn(n, E, dtype=torch.float64) for n in LENGTHS]
    sources = [torch.randn(n + 2, E, dtype=torch.float64) for n in reversed(LENGTHS)]
    x, mask = pad(seqs, side)
    with torch.no_grad():
        if role == "cross":
            s, smask = pad(sources, side)
            batch = module(x, s, s, key_padding_mask=smask)[0]
        else:
            batch = module(x, x, x, key_padding_mask=mask)[0]
        for b, seq in enumerate(seqs):
            src = sources[b][:, None] if role == "cross" else seq[:, None]
            alone = module(seq[:, None], src, src)[0][:, 0]
            torch.testing.assert_close(real(batch, mask, b), alone, rtol=0, atol=1e-12,
                                       msg=lambda m: f"sequence {b} ({len(seq)} tokens), {method} {role}: {m}")


@pytest.mark.parametrize("method", ["lln", "lln_diag"])
def test_training_keeps_the_batch_statistics_and_eval_reads_the_running_ones(method, gen):
    # training: the paper's statistics of the current batch; eval: the running average of the batches trained on
    module = build(method, "encoder", gen, "batch").train()
    xs = [torch.randn(7 + i, 2, E, dtype=torch.float64, generator=gen) * (1 + i) for i in range(3)]
    batch_var = []
    for x in xs:
        module(x, x, x)[0].sum().backward()
        batch_var.append(module.matcher.last_sigma_q ** 2)
    matcher = module.matcher
    assert matcher.running_batches.item() == 3
    expected = batch_var[0]
    for n, v in enumerate(batch_var[1:], 2):  # the first batches are averaged with equal weights
        m = min(1 - 1 / n, matcher.ema_momentum)
        expected = m * expected + (1 - m) * v
    torch.testing.assert_close(matcher.running_var_q.double(), expected, rtol=1e-6, atol=0)
    with torch.no_grad():  # a training forward without grad (activation checkpointing's first pass) folds nothing
        module(xs[0], xs[0], xs[0])
    assert matcher.running_batches.item() == 3
    module.eval()
    module(xs[0], xs[0], xs[0])
    # every sequence of the batch gets the running statistics (chosen on the device, so shaped (B, G))
    running = matcher.running_var_q.double().sqrt().expand_as(matcher.last_sigma_q)
    torch.testing.assert_close(matcher.last_sigma_q, running, rtol=1e-12, atol=0)


def test_a_checkpoint_without_running_statistics_loads_and_evaluates_each_sequence_alone(gen):
    module = build("lln", "encoder", gen, "batch")
    state = {k: v for k, v in module.state_dict().items() if not k.startswith("matcher.running_")}
    state = {"layer." + k: v for k, v in state.items()}
    module.upgrade_state_dict_named(state, "layer")
    module.load_state_dict({k[len("layer."):]: v for k, v in state.items()})
    assert module.matcher.running_batches.item() == 0
    x, mask = pad([torch.randn(n, E, dtype=torch.float64) for n in (5, 8)], "right")
    module.eval()(x, x, x, key_padding_mask=mask)
    assert module.matcher.last_alpha.shape == (2, H)  # per sequence and head


def sentence_classifier(root, attention):
    """linattn_roberta_tiny with a two-class head, built through fairseq's sentence_prediction task."""
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq_data import USER_DIR

    for sub, symbols in (("input0", [f"w{i}" for i in range(40)]), ("label", ["0", "1"])):
        (root / sub).mkdir(parents=True, exist_ok=True)
        (root / sub / "dict.txt").write_text("".join(f"{s} 1\n" for s in symbols))
    args = options.parse_args_and_arch(options.get_training_parser(), [
        str(root), "--task", "sentence_prediction", "--num-classes", "2", "--arch", "linattn_roberta_tiny",
        "--encoder-attention-type", attention, "--lln-diag-block-size", "4", "--max-positions", "64",
        "--criterion", "sentence_prediction", "--dropout", "0", "--attention-dropout", "0", "--user-dir", USER_DIR,
        "--cpu"])
    cfg = convert_namespace_to_omegaconf(args)
    task = tasks.setup_task(cfg.task)
    return task, task.build_model(cfg.model)


def evaluate(model, task, sentences, labels, batch_size):
    """Summed cross-entropy and correct count over ``sentences``, batched as fairseq batches them (right padding)."""
    from fairseq.data import data_utils

    logits = []
    for i in range(0, len(sentences), batch_size):
        tokens = data_utils.collate_tokens(sentences[i:i + batch_size], task.source_dictionary.pad())
        logits.append(model(tokens, features_only=True, classification_head_name="sentence_classification_head")[0])
    logits = torch.cat(logits).double()
    loss = torch.nn.functional.cross_entropy(logits, labels, reduction="sum").item()
    return loss, (logits.argmax(-1) == labels).sum().item(), logits


@pytest.mark.parametrize("attention", ["lln", "lln_diag"])
def test_sentence_classifier_scores_the_same_at_batch_size_1_and_16(attention, tmp_path, gen):
    from fairseq.data import data_utils

    torch.manual_seed(0)
    task, model = sentence_classifier(tmp_path, attention)
    model.double()
    d = task.source_dictionary
    sentences = [torch.cat([torch.tensor([d.bos()]), torch.randint(d.nspecial, len(d), (int(n),), generator=gen),
                            torch.tensor([d.eos()])]) for n in torch.randint(2, 30, (32,), generator=gen)]
    labels = torch.randint(0, 2, (32,), generator=gen)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model.train()
    for i in range(0, 32, 16):  # two updates: the running statistics eval reads
        tokens = data_utils.collate_tokens(sentences[i:i + 16], d.pad())
        logits = model(tokens, features_only=True, classification_head_name="sentence_classification_head")[0]
        torch.nn.functional.cross_entropy(logits, labels[i:i + 16]).backward()
        assert model.training
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    with torch.no_grad():
        (loss_1, correct_1, logits_1), (loss_16, correct_16, logits_16) = (
            evaluate(model, task, sentences, labels, bs) for bs in (1, 16))
    # float64: batching changes the logits by float64 rounding only (batch statistics in eval: about 1e-5)
    assert correct_1 == correct_16
    assert loss_1 == pytest.approx(loss_16, rel=1e-12, abs=0)
    torch.testing.assert_close(logits_1, logits_16, rtol=0, atol=1e-11)
