"""The reproduction ledger: the committed docs/reproduction.md is what its JSON renders, and every
"holds" is computed (a claim stops holding when the numbers that support it are broken)."""
import copy
import json
import math
import subprocess
import sys

import pytest
import torch
from helpers import ROOT

from linattn_tools.benchmark import fit
from linattn_tools.reproduce import (
    claims,
    common,
    decoding,
    front_page,
    gpu_speed,
    ledger,
    lln_distribution,
    quickstart,
    skyformer_error,
    skyformer_fig1,
)


@pytest.fixture(scope="module")
def records():
    found = ledger.load_results()
    missing = [g for g in common.GROUPS if g not in found]
    assert not missing, f"no committed result file for {missing} in {common.RESULTS_DIR}"
    return found


def verdict(records, claim_id):
    claim = next(c for c in claims.CLAIMS if c.id == claim_id)
    return claim.evaluate(records[claim.group])


# ----------------------------------------------------------------------------- the committed ledger

def test_committed_ledger_is_what_the_committed_json_renders(records):
    assert common.LEDGER.read_text() == ledger.render(records), \
        "docs/reproduction.md is stale or edited by hand: run `bash scripts/reproduce.sh --render`"


def test_render_check_mode_reports_a_stale_ledger_or_readme(tmp_path):
    stale = tmp_path / "reproduction.md"
    stale.write_text(common.LEDGER.read_text().replace("**yes**", "**no**", 1))
    readme = tmp_path / "README.md"
    readme.write_text(front_page.README.read_text().replace("| 89.0 |", "| 98.0 |", 1))
    args = [sys.executable, "-m", "linattn_tools.reproduce", "render", "--check", "--ledger"]
    run = lambda *a: subprocess.run(args + [str(p) for p in a], cwd=ROOT, capture_output=True, text=True)  # noqa: E731
    assert run(stale).returncode == 1
    proc = run(common.LEDGER, "--readme", readme)
    assert proc.returncode == 1 and f"{readme} differs" in proc.stderr
    assert run(common.LEDGER).returncode == 0


def test_every_claim_has_a_verdict_from_the_committed_json(records):
    for claim, v in claims.evaluate_all(records):
        assert v is not None, claim.id
        assert v.paper and v.ours and v.test, claim.id
        if v.holds is False:
            assert v.cause, f"{claim.id} does not hold and gives no likely cause"


def test_claim_ids_are_unique():
    ids = [c.id for c in claims.CLAIMS]
    assert len(ids) == len(set(ids))


# ----------------------------------------------------------------------------- "holds" is computed

def _dist(rec):
    return [p for d in rec["results"]["per_head_dim"].values() for p in d["points"]]


def _set_var(rec, method, factor):
    for p in _dist(rec):
        p[method]["log_p_var"] = p["softmax"]["log_p_var"] * factor


def _scale_cost(rec, method, key, factor, dropout=None):
    keys = ("seconds", "min_seconds") if key == "seconds" else (key,)  # a time edit moves median and fastest
    for p in rec["results"]["points"]:
        if p["method"] == method and (dropout is None or p["attention_dropout"] == dropout):
            for k in keys:
                p[k] = p[k] * factor if not callable(factor) else factor(p)


def _lm(rec, method, ppls):
    for row, ppl in zip(rec["results"]["lm"][method]["contexts"], ppls):
        row["ppl"] = ppl


def _gen(rec, method, fn):
    runs = rec["results"]["runs"]
    for n in runs[method]["cpu_seconds"]:
        runs[method]["cpu_seconds"][n] = fn(int(n), runs["softmax"]["cpu_seconds"][n])


def _fig1(rec, fn):
    """errors[arm][method][N][d] = [fn(method, N, d)]."""
    for arm in rec["results"]["arms"].values():
        for m, per_n in arm["errors"].items():
            for n, row in per_n.items():
                for d in row:
                    row[d] = [fn(m, int(n), int(d))]


BREAKS = {  # claim id -> an edit of its result record under which the claim must not hold
    "lln-prop31": lambda r: [p["softmax"].update(log_p_var=1.5 * p["theory_log_p_var"]) for p in _dist(r)],
    "lln-fig5b-paper": lambda r: _set_var(r, "lln_paper", 1.5),
    "lln-fig5b-fit": lambda r: _set_var(r, "lln_fit", 0.5),
    "lln-fig5b-exact": lambda r: _set_var(r, "lln_exact", 1.3),
    "lln-fig5b-unmatched": lambda r: _set_var(r, "lln_unmatched", 0.9),
    "lln-fig2-entropy": lambda r: [p["lln_paper"].update(entropy_bits=p["lln_unmatched"]["entropy_bits"])
                                   for p in _dist(r)],
    "lln-fig2-gap": lambda r: [p["lln_paper"].update(spectral_gap=p["lln_unmatched"]["spectral_gap"])
                               for p in _dist(r)],
    "lln-table2-linear": lambda r: _scale_cost(r, "lln", "seconds", lambda p: p["n"] ** 2 / 1e6),
    "lln-table2-speed": lambda r: _scale_cost(r, "lln_diag", "seconds", 100.0),
    "lln-table2-longest": lambda r: _scale_cost(r, "lln", "total_bytes", lambda p: p["n"] ** 2 * 1000),
    "lln-table2-longest-diag": lambda r: _scale_cost(r, "lln_diag", "total_bytes", lambda p: p["n"] ** 2 * 1000),
    "lln-table2-longest-flash": lambda r: _scale_cost(r, "softmax", "total_bytes", 1 / 8, dropout=0.0),
    "lln-table2-diag-memory": lambda r: _scale_cost(r, "lln_diag", "total_bytes", 1.5),
    "lln-table1-mlm": lambda r: r["results"]["encoder"]["lln"].update(
        mlm_valid_loss=r["results"]["encoder"]["softmax"]["mlm_valid_loss"] - 0.5),
    "lln-table1-finetune": lambda r: r["results"]["encoder"]["lln_diag"].update(
        finetune_accuracy=r["results"]["encoder"]["softmax"]["finetune_accuracy"] - 50),
    "lavo-table2-flat": lambda r: _lm(r, "lavo", [10.0, 12.0, 15.0]),
    "lavo-table2-softmax": lambda r: _lm(r, "softmax", [10.0, 10.1, 10.0]),
    "lavo-table10-trend": lambda r: _gen(r, "lavo", lambda n, sm: 2 * sm),
    "lavo-table10-8k": lambda r: _gen(r, "lavo", lambda n, sm: sm),
    "sky-fig1-landmarks": lambda r: _fig1(r, lambda m, n, d: 0.5),
    "sky-fig1-others": lambda r: _fig1(r, lambda m, n, d: 1 / d),
    "sky-fig1-length": lambda r: _fig1(r, lambda m, n, d: n / d),
}

def _diag_like_lln(rec, factor):
    lln = {p["n"]: p["total_bytes"] for p in rec["results"]["points"] if p["method"] == "lln"}
    for p in rec["results"]["points"]:
        if p["method"] == "lln_diag" and p["n"] in lln:
            p["total_bytes"] = lln[p["n"]] * factor


def _theory(rec):
    for p in _dist(rec):
        p["softmax"].update(log_p_var=p["theory_log_p_var"], log_p_mean=p["theory_log_p_mean"])


MENDS = {  # claim id -> an edit under which it must hold
    "lln-prop31": _theory,
    "lln-fig5b-exact": lambda r: _set_var(r, "lln_exact", 1.0),
    "lln-fig5b-unmatched": lambda r: _set_var(r, "lln_unmatched", 0.1),
    "lln-table2-linear": lambda r: [_scale_cost(r, m, "seconds", lambda p: p["n"] / 1e3) for m in ("lln", "lln_diag")],
    "lln-table2-speed": lambda r: (_scale_cost(r, "softmax", "seconds", lambda p: p["n"] ** 2 / 1e6, dropout=0.1),
                                   _scale_cost(r, "lln_diag", "seconds", lambda p: p["n"] / 1e3)),
    "lln-table2-longest": lambda r: _scale_cost(r, "lln", "total_bytes", lambda p: 1e9 + 1e5 * p["n"]),
    "lln-table2-longest-diag": lambda r: _scale_cost(r, "lln_diag", "total_bytes", lambda p: 1e9 + 1e5 * p["n"]),
    "lln-table2-diag-memory": lambda r: _diag_like_lln(r, 1.05),
    "lln-fig5b-paper": lambda r: _set_var(r, "lln_paper", 1.05),
    "lln-fig5b-fit": lambda r: _set_var(r, "lln_fit", 0.95),
    "lln-fig2-entropy": lambda r: [p["lln_paper"].update(entropy_bits=p["softmax"]["entropy_bits"]) for p in _dist(r)],
    "lln-fig2-gap": lambda r: [p["lln_paper"].update(spectral_gap=p["softmax"]["spectral_gap"]) for p in _dist(r)],
    "lln-table2-longest-flash": lambda r: _scale_cost(r, "softmax", "total_bytes", lambda p: p["n"] ** 2 * 1000, 0.0),
    "lln-table1-mlm": lambda r: r["results"]["encoder"].update(
        softmax={"mlm_valid_loss": 5.0}, lln_diag={"mlm_valid_loss": 5.05}, lln={"mlm_valid_loss": 5.5}),
    "lln-table1-finetune": lambda r: r["results"]["encoder"].update(
        softmax={"finetune_accuracy": 90.0}, lln_diag={"finetune_accuracy": 89.9}, lln={"finetune_accuracy": 88.4}),
    "lavo-table2-flat": lambda r: _lm(r, "lavo", [19.43, 19.41, 19.40]),
    "lavo-table2-softmax": lambda r: _lm(r, "softmax", [16.02, 40.33, 94.34]),
    "lavo-table10-trend": lambda r: _gen(r, "lavo", lambda n, sm: sm * 1024 / n),
    "lavo-table10-8k": lambda r: _gen(r, "lavo", lambda n, sm: sm / 4),
    "sky-fig1-landmarks": lambda r: _fig1(r, lambda m, n, d: 1 / d),
    "sky-fig1-others": lambda r: _fig1(r, lambda m, n, d: 1 / d if m == "skyformer" else 0.5 - d / 1e4),
    "sky-fig1-length": lambda r: _fig1(r, lambda m, n, d: 1 / (n * d)),
}


def test_every_tested_claim_has_a_break(records):
    tested = [c.id for c, v in claims.evaluate_all(records) if v.holds is not None]
    assert sorted(tested) == sorted(BREAKS)


@pytest.mark.parametrize("claim_id", sorted(BREAKS))
def test_a_claim_does_not_hold_when_its_numbers_are_broken(records, claim_id, tmp_path):
    broken = copy.deepcopy(records)
    claim = next(c for c in claims.CLAIMS if c.id == claim_id)
    BREAKS[claim_id](broken[claim.group])
    v = claim.evaluate(broken[claim.group])
    assert v.holds is False
    # the rendered ledger says so, with the likely cause
    section = ledger.render(broken).split(f"### {claim_id}\n", 1)[1].split("###", 1)[0]
    assert "Holds here: **no**" in section and "Likely cause" in section


@pytest.mark.parametrize("claim_id", sorted(MENDS))
def test_a_claim_holds_when_its_numbers_agree_with_the_paper(records, claim_id):
    mended = copy.deepcopy(records)
    claim = next(c for c in claims.CLAIMS if c.id == claim_id)
    MENDS[claim_id](mended[claim.group])
    assert claim.evaluate(mended[claim.group]).holds is True


# ----------------------------------------------------------------------------- the arithmetic behind the rows

def test_polyfit_recovers_a_quadratic_and_longest_fitting_inverts_it():
    coef = [1.5e9, 2e5, 300.0]
    ns = [512, 1024, 1536, 2048]
    coef_fit = fit.polyfit(ns, [coef[0] + coef[1] * n + coef[2] * n * n for n in ns], 2)
    assert coef_fit == pytest.approx(coef, rel=1e-6)
    n_max = fit.longest_fitting(coef_fit, 24 * 2 ** 30)
    assert coef[0] + coef[1] * n_max + coef[2] * n_max ** 2 == pytest.approx(24 * 2 ** 30, rel=1e-9)
    assert fit.longest_fitting([1e9, 1e6], 2e9) == pytest.approx(1000)


def test_longest_n_fits_the_two_longest_sizes_linearly_and_every_size_quadratically():
    ns = [1024, 2048, 4096]
    linear = [3e9, 1e9 + 1e6 * 2048, 1e9 + 1e6 * 4096]  # the shortest point is off the line: not fitted
    f = fit.longest_n(ns, linear, 2e9, quadratic=False)
    assert f["used"] == [2048, 4096] and f["n_max"] == pytest.approx(1000)
    assert f["grid_max"] == 512 and f["residual"] == pytest.approx(0, abs=1e-9)
    quad = [1e9 + 10 * n * n for n in ns]
    f = fit.longest_n(ns, quad, 2e9, quadratic=True)
    assert f["used"] == ns and f["n_max"] == pytest.approx(1e4, rel=1e-6)
    assert math.isinf(fit.longest_n(ns, [3e9, 2e9, 1e9], 2e9, quadratic=False)["n_max"])


def test_power_exponent_of_a_power_law():
    assert claims.power_exponent([1, 2, 4, 8], [3 * n ** 1.3 for n in (1, 2, 4, 8)]) == pytest.approx(1.3)


# ----------------------------------------------------------------------------- the measuring code, at tiny sizes

def test_lln_distribution_measures_softmax_close_to_prop31():
    res = lln_distribution.measure(**lln_distribution.QUICK)
    (only,) = res["per_head_dim"].values()
    for p in only["points"]:
        assert set(lln_distribution.METHODS) <= set(p)
        assert p["softmax"]["log_p_var"] == pytest.approx(p["theory_log_p_var"], rel=0.3)
        assert p["lln_unmatched"]["log_p_var"] < p["softmax"]["log_p_var"]
    assert only["fit"]["a"] > 0


def test_skyformer_error_falls_with_more_landmarks():
    res = skyformer_error.measure(**skyformer_error.QUICK)
    for per_n in res["errors"].values():
        for row in per_n.values():
            few, many = (row[str(d)] for d in skyformer_error.QUICK["landmarks"])
            assert 0 < many < few


def _log_line(tag, **values):
    prefix = "" if tag == "train_inner" else f"{tag}_"
    return json.dumps({f"{prefix}{k}": str(v) for k, v in values.items()})


def test_quickstart_collect_reads_logs_and_extrapolation_tables(tmp_path):
    run = tmp_path / "run"
    for i, attn in enumerate(("softmax", "lln", "lln_diag")):
        for part, lines in (("pretrain", [_log_line("train_inner", loss=9 + i, num_updates=10),
                                          _log_line("valid", loss=8 + i, num_updates=10)]),
                            ("finetune", [_log_line("valid", loss=1, accuracy=70 + i, num_updates=5),
                                          _log_line("valid", loss=1, accuracy=60, num_updates=10)])):
            (run / part / attn).mkdir(parents=True)
            (run / part / attn / "train.log").write_text("\n".join(lines) + "\n")
    (run / "lm" / "lavo").mkdir(parents=True)
    (run / "lm" / "lavo" / "train.log").write_text(_log_line("train_inner", loss=7, num_updates=3) + "\n")
    (run / "lm" / "lavo" / "extrapolation.tsv").write_text(
        "context\tratio\tloss_bits\tppl\tword_ppl\n128\t1\t4\t16.0\tnan\n256\t2\t4.1\t17.1\tnan\n")
    (run / "REPORT.md").write_text("# Quick-start report\n\n| setting | value |\n|---|---|\n| seed | 1 |\n\n## x\n")
    res = quickstart.collect(run)
    assert res["settings"] == {"seed": "1"}
    assert res["encoder"]["lln"]["mlm_valid_loss"] == 9.0
    assert res["encoder"]["lln_diag"]["finetune_accuracy"] == 72.0
    assert res["lm"]["lavo"]["contexts"] == [{"context": 128, "ratio": 1.0, "ppl": 16.0},
                                             {"context": 256, "ratio": 2.0, "ppl": 17.1}]
    with pytest.raises(FileNotFoundError):
        quickstart.collect(tmp_path / "empty")


def test_help_prints_the_expected_wall_time():
    out = subprocess.run(["bash", str(ROOT / "scripts" / "reproduce.sh"), "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    assert "expected wall time about" in out.stdout and "as the committed run took" in out.stdout


@pytest.mark.extended
def test_reproduce_runs_end_to_end_in_quick_mode(tmp_path):
    ledger_path = tmp_path / "ledger.md"
    cmd = ["bash", str(ROOT / "scripts" / "reproduce.sh"), "--quick", "--only", "lln_distribution",
           "skyformer_error", "skyformer_fig1", "decoding", "lln_cost", "--out", str(tmp_path), "--ledger",
           str(ledger_path)]
    readme = (ROOT / "README.md").read_text()
    subprocess.run(cmd, check=True, cwd=ROOT)
    assert (ROOT / "README.md").read_text() == readme  # a run into another directory leaves the README alone
    assert (tmp_path / "skyformer_fig1.png").is_file()
    for group in ("lln_distribution", "skyformer_error", "skyformer_fig1", "decoding", "lln_cost"):
        record = json.loads((tmp_path / f"{group}.json").read_text())
        assert record["command"].startswith(f"bash scripts/reproduce.sh --only {group}")
        assert math.isfinite(record["wall_s"])
    text = ledger_path.read_text()
    assert "## Notes per claim" in text and "lavo-table10-trend" in text


def test_the_decoding_vocabulary_is_gpt2_s_scaled_to_the_measured_layers():
    from linattn_tools.benchmark import fairseq_models

    assert decoding.DEFAULTS["vocab"] == round(fairseq_models.GPT2_VOCAB * 2 / decoding.FULL_LAYERS / 8) * 8
    assert decoding.DEFAULTS["layers"] == 2


# ----------------------------------------------------------------------------- Skyformer Fig. 1's encoders

def test_bert_initialised_encoder_has_bert_shapes_and_scores_of_the_expected_spread():
    enc = skyformer_fig1.initialised_encoder(skyformer_fig1.BERT, vocab=50, max_len=64, seed=0)
    ids = torch.randint(0, 50, (64,), generator=torch.Generator().manual_seed(0))
    q, k, v = enc.qkv_heads(ids)
    assert q.shape == k.shape == v.shape == (1, 12, 64, 64)
    # LayerNorm'd x (unit entries) times std-0.02 weights: q·k / 8 has std 0.02² · 768 · sqrt(64) / 8 ≈ 0.31
    scores = q @ k.transpose(-1, -2) / 8
    assert scores.std().item() == pytest.approx(0.02 ** 2 * 768, rel=0.25)


def test_every_fig1_method_runs_and_skyformer_caption_is_near_exact_with_many_features():
    enc = skyformer_fig1.initialised_encoder(skyformer_fig1.TINY, vocab=50, max_len=64, seed=0)
    q, k, v = enc.qkv_heads(torch.arange(64) % 50)
    exact = skyformer_fig1.fa.softmax_output(q, k, v)
    gen = torch.Generator().manual_seed(0)
    for m in skyformer_fig1.METHODS:
        assert skyformer_fig1.approximate(m, q, k, v, 16, gen).shape == exact.shape
    err = skyformer_fig1.fa.spectral_error(skyformer_fig1.approximate("skyformer", q, k, v, 128, gen), exact)
    assert err.max().item() < 1e-6


# ----------------------------------------------------------------------------- the GPU rows

def _gpu_record(tmp_path, sm_train, lln_train, lavo_train, sm_decode, lavo_decode):
    pts = lambda times: [{"n": n, "status": "ok", "median_s": t} for n, t in times.items()]
    data = {"config": {"train_arch": "linattn_roberta_base", "decode_arch": "linattn_lm_gpt", "batch": 1},
            "machine": {"device": "cuda:0", "gpu": "NVIDIA Test GPU", "cpu_count": 16},
            "train": {"points": {"softmax": pts(sm_train), "lln": pts(lln_train), "lavo": pts(lavo_train)}},
            "decode": {"points": {"softmax": pts(sm_decode), "lavo": pts(lavo_decode)}}, "date": "2026-11-26"}
    (tmp_path / "cpu.json").write_text(json.dumps({"machine": {"device": "cpu"}, "train": {"points": {}}}))
    (tmp_path / "model_gpu.json").write_text(json.dumps(data))
    return gpu_speed.record(tmp_path)


def _gpu_verdicts(rec):
    return {c.id: c.evaluate(rec) for c in claims.CLAIMS if c.group == "gpu_benchmark"}


def test_gpu_rows_hold_nothing_and_say_so_without_a_gpu_benchmark(tmp_path):
    rec = gpu_speed.record(tmp_path)
    assert rec["source"] is None
    for claim_id, v in _gpu_verdicts(rec).items():
        assert v.holds is None and "no GPU benchmark committed yet" in v.ours, claim_id


def test_gpu_rows_are_judged_on_a_gpu_benchmark_naming_card_dtype_and_date(tmp_path):
    ns = (4096, 8192, 16384)
    good = _gpu_record(tmp_path, {n: n * n / 1e6 for n in ns}, {n: n / 1e3 for n in ns}, {n: n / 1e3 for n in ns},
                       {n: n / 1e5 for n in (2048, 4096, 8192)}, {n: 0.01 for n in (2048, 4096, 8192)})
    assert good["source"].endswith("model_gpu.json")
    verdicts = _gpu_verdicts(good)
    assert all(v.holds is True for v in verdicts.values()), {k: v.ours for k, v in verdicts.items()}
    assert "NVIDIA Test GPU, float32, 2026-11-26" in verdicts["lln-table2-speed-gpu"].note
    bad = _gpu_record(tmp_path, {n: 1.0 for n in ns}, {n: 2.0 for n in ns}, {n: 2.0 for n in ns},
                      {n: 0.01 for n in (2048, 4096, 8192)}, {n: 0.01 for n in (2048, 4096, 8192)})
    for claim_id, v in _gpu_verdicts(bad).items():
        assert v.holds is False and v.cause, claim_id
    text = ledger.render({**copy.deepcopy(ledger.load_results()), "gpu_benchmark": bad})
    assert "read from `" in text and "NVIDIA Test GPU" in text


def test_generation_total_is_the_trapezoid_over_the_step_times():
    from linattn_tools.reproduce.claims.gpu import generation_totals

    assert generation_totals({2: 1.0, 4: 3.0}, 4) == pytest.approx(2 * 1.0 + 2 * (1.0 + 3.0) / 2)
    with pytest.raises(ValueError):
        generation_totals({2: 1.0}, 4)
