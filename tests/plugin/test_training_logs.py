"""The plugin's statistics in fairseq's logs: each worker's logging output carries sums, the log shows their mean."""
from fairseq import metrics

from fairseq_linattn import training_logs


def test_reduced_statistics_are_the_mean_over_the_workers_logging_outputs():
    outputs = [{"linattn_lln_alpha_sum": 2.0, "linattn_lln_tau_sum": 1.0, "linattn_count": 1, "loss": 3.0},
               {"linattn_lln_alpha_sum": 4.0, "linattn_lln_tau_sum": 0.5, "linattn_count": 1, "loss": 1.0},
               {"loss": 2.0}]  # a worker whose model has no plugin statistics
    with metrics.aggregate(new_root=True) as agg:
        training_logs._reduce(outputs)
    logged = agg.get_smoothed_values()
    assert logged["lln_alpha"] == 3.0 and logged["lln_tau"] == 0.75
    assert "loss" not in logged and "count" not in logged


def test_nothing_is_logged_without_plugin_statistics():
    with metrics.aggregate(new_root=True) as agg:
        training_logs._reduce([{"loss": 1.0}, {"loss": 2.0}])
    assert dict(agg.get_smoothed_values()) == {}
