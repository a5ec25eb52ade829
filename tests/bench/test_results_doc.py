"""docs/results.md and the README's results block are generated from committed records."""

from __future__ import annotations

from conftest import ROOT

from jaxlab.bench.record import load_records
from jaxlab.bench.results_doc import headline_table, load_all, readme_with_results, render


def committed_sets():
    return sorted(
        p for p in (ROOT / "docs" / "benchmarks").iterdir() if (p / "records.jsonl").is_file()
    )


def test_results_doc_regenerates_exactly():
    sets = committed_sets()
    assert sets, "no committed record set under docs/benchmarks/"
    for s in sets:
        assert load_records(s)  # every record validates against the schema
    recs = load_all(sets)
    doc = ROOT / "docs" / "results.md"
    assert render(sets, recs, doc.parent) == doc.read_text(), (
        "docs/results.md differs from its records: run `jaxlab bench results "
        + " ".join(str(s.relative_to(ROOT)) for s in sets)
        + "`"
    )
    readme = (ROOT / "README.md").read_text()
    assert readme_with_results(readme, recs) == readme, "README results block is stale"


def test_the_serve_headline_comes_from_a_128_token_comparison_not_a_quick_run():
    """The serve target is set at 128 new tokens; a later --quick set (32 tokens) must not
    replace it in the headline."""
    recs = load_all(committed_sets())
    speedups = [r for r in recs if r.metric == "slots_speedup" and r.status == "ok"]
    assert {r.case["new_tokens"] for r in speedups} >= {32, 128}
    full = [r for r in speedups if r.case["new_tokens"] == 128]
    rows = [line for line in headline_table(recs) if "16 slots / 1 slot" in line]
    assert len(rows) == 1 and "new_tokens=128" in rows[0]
    greedy = [r for r in full if r.case["sampling"] == "greedy"][-1]
    assert f"**{greedy.stats.median:.3g}x**" in rows[0]
