"""``tidal bench curate`` on a small corpus without datatrove (its venv install is the full run's)."""

from tidal.bench import load


def test_curate_benchmark_measures_tidal_and_finds_the_planted_copies(tmp_path):
    out = load("curate").run(["docs=200", "words=120", "datatrove=false"], tmp_path / "bench")
    rows = {r["stage"]: r for r in out["table"]}
    assert set(rows) == {"near-dedup", "gopher-quality"}
    assert rows["near-dedup"]["planted_removed"] >= 0.95 and rows["near-dedup"]["others_removed"] == 0
    assert all(r["docs_per_s"] > 0 for r in rows.values())
    assert out["tidal_over_datatrove"] == {}
