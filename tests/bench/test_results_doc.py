"""docs/results.md and the README's results block are generated from committed records."""

from __future__ import annotations

from conftest import ROOT

from jaxlab.bench.record import load_records
from jaxlab.bench.results_doc import load_all, readme_with_results, render


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
