"""The papers' figures as data: lookups, our method -> paper row mapping, table shapes."""
import math

import pytest

from linattn_tools.recipes import paper_results as pr


def test_every_table_row_has_one_value_per_column_and_every_mapping_names_a_row():
    for key, table in pr.TABLES.items():
        assert table.source and table.setting and table.unit, key
        for label, values in table.rows.items():
            assert len(values) == len(table.columns), (key, label)
            assert all(v is None or v == pr.OOM or (isinstance(v, (int, float)) and math.isfinite(v))
                       for v in values), (key, label)
        assert set(table.ours.values()) <= set(table.rows), key
        assert set(table.notes) <= set(table.rows), key


def test_glue_maps_our_methods_to_lln_table1_rows():
    assert [pr.glue(t, "softmax") for t in ("mnli", "qnli", "qqp", "sst2", "avg")] == [80.3, 87.2, 89.9, 90.6, 87.0]
    assert [pr.glue(t, "lln") for t in ("mnli", "qnli", "qqp", "sst2")] == [77.0, 85.1, 88.9, 90.6]
    assert [pr.glue(t, "lln_diag") for t in ("mnli", "qnli", "qqp", "sst2")] == [80.0, 86.5, 89.7, 91.6]
    assert pr.glue("SST-2", "Performer") == 81.4 and pr.glue("mnli", "elu") == 74.8
    # no figure: a "-" cell, a method the table lacks, a sample task, a per-layer list
    assert pr.glue("qnli", "Reformer") is None
    assert pr.glue("mnli", "lavo") is None and pr.glue("kjv_testament", "softmax") is None
    assert pr.glue("mnli", "softmax,lln") is None


def test_pg19_maps_softmax_to_flashattention_and_context_factors_to_lavo_table2_columns():
    assert [pr.pg19_ppl("lavo", f) for f in (1, 1.5, 2)] == [19.43, 19.41, 19.40]
    assert [pr.pg19_ppl("softmax", f) for f in (1, 1.5, 2)] == [16.02, 40.33, 94.34]
    assert pr.pg19_ppl("FA + RoPE", 2) == 34.84 and pr.pg19_ppl("local", 1.5) == 21.24
    assert pr.pg19_ppl("vanilla", 1) == pr.OOM
    assert pr.pg19_ppl("S4D", 2) is None and pr.pg19_ppl("lln", 1) is None and pr.pg19_ppl("lavo", 3) is None
    assert pr.pg19_memory_mb("lavo", 2) == 9337 and pr.pg19_speedup("lavo", 1) == 11.49
    assert pr.generation_speedup("lavo", 2) == 20.81 and pr.generation_speedup("softmax", 1) == 7.94
    cell = pr.figure("lavo_table2_ppl", "softmax", 8192)
    assert cell.row == "FlashAttention" and "Table 2" in cell.source and "8192" in cell.setting


def test_lln_table2_and_lra_tables():
    assert pr.lln_speed("softmax", 4096) == 6.8 and pr.lln_speed("softmax", 8192) == pr.OOM
    assert pr.lln_memory("lln_diag", 16384) == 23.0 and pr.lln_memory("lln", 1000) is None
    assert pr.lra("avg", "lavo") == 59.74 and pr.lra("avg", "skyformer", source="skyformer") == 59.39
    assert pr.lra("image", "softmax") == 40.58 and pr.lra("image", "softmax", source="skyformer") == 40.57
    assert pr.lra("text", "kernelized") == 60.22 and pr.lra("avg", "lln_diag", source="lln") == 57.86
    assert pr.lra("text", "lln") is None
    with pytest.raises(KeyError):
        pr.lra("text", "lavo", source="nope")
