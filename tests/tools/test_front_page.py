"""The README's results section: the committed README holds what the committed JSON renders, and every figure in it
comes from the JSON (the quick-start's tables, the ledger's count, the GPU table)."""
import copy
import json
import shutil

import pytest

from linattn_tools.reproduce import common, front_page, ledger
from linattn_tools.reproduce.__main__ import render


@pytest.fixture(scope="module")
def records():
    return ledger.load_results()


def test_committed_readme_results_are_what_the_committed_json_renders(records):
    section = front_page.section(records, *ledger.claim_counts(records), front_page.load_gpu_targets())
    readme = front_page.README.read_text()
    assert front_page.replace(readme, section) == readme, \
        "README.md's results are stale or edited by hand: run `bash scripts/reproduce.sh --render`"


def test_readme_results_follow_the_records_and_the_gpu_file(records):
    """Every figure comes from the JSON: a changed accuracy, perplexity, claim count or GPU time shows."""
    gpu = front_page.load_gpu_targets()
    changed = copy.deepcopy(records)
    changed["quickstart"]["results"]["encoder"]["lln"]["finetune_accuracy"] = 12.3
    changed["quickstart"]["results"]["lm"]["lavo"]["contexts"][2]["ppl"] = 999.4
    faster = copy.deepcopy(gpu)
    row = next(r for r in faster["runs"][front_page.GPU_RUN]["rows"]
               if (r["method"], r["causal"], r["n"], r["dtype"]) == ("lln", True, 32768, "float16"))
    soft = next(r for r in faster["runs"][front_page.GPU_RUN]["rows"]
                if (r["method"], r["causal"], r["n"], r["dtype"]) == ("softmax", True, 32768, "float16"))
    row["median_s"] = soft["median_s"] / 4
    text = front_page.section(changed, 7, 9, faster)
    assert "| LLN | 8.162 | 12.3 |" in text and "| 156.5 | 999.4 |" in text
    assert "7 of 9 tested claims hold" in text
    lln_causal = next(line for line in text.splitlines() if line.startswith("| LLN, causal |"))
    assert lln_causal.endswith("| 0.25× |") and faster["date"] in text and faster["kernels_commit"] in text
    assert "no GPU measurement" in front_page.section(records, 1, 2, None)
    with pytest.raises(ValueError, match="no results markers"):
        front_page.replace("# a README without markers\n", text)


def test_render_from_other_results_writes_the_readme_only_when_asked(tmp_path):
    """Results measured elsewhere (``reproduce run --out DIR``, a quick run) render their ledger; the README's
    section changes only through ``--readme``, never the committed README by default."""
    results = tmp_path / "results"
    shutil.copytree(common.RESULTS_DIR, results)
    record = json.loads((results / "quickstart.json").read_text())
    record["results"]["encoder"]["lln"]["finetune_accuracy"] = 12.3
    (results / "quickstart.json").write_text(json.dumps(record))
    committed = front_page.README.read_text()
    assert render(results, tmp_path / "ledger.md", check=False) == 0
    assert front_page.README.read_text() == committed and (tmp_path / "ledger.md").is_file()
    readme = tmp_path / "README.md"
    readme.write_text(committed)
    assert render(results, tmp_path / "ledger.md", check=False, readme=readme) == 0
    assert "| LLN | 8.162 | 12.3 |" in readme.read_text() and "| 12.3 |" not in committed
