"""The held-out llm-d folder (benchmarks/published_cluster_heldout) is a valid `servetwin validate` directory."""
from pathlib import Path

from servetwin.experiments.config.schema import load_config
from servetwin.experiments.validate.published import load_published

HELDOUT = Path(__file__).resolve().parents[2] / "benchmarks" / "published_cluster_heldout"


def test_every_heldout_case_parses_and_has_its_published_figures():
    cases, published = load_published(HELDOUT)  # unknown metric names and stage metrics fail here
    assert set(cases) == set(published) and len(cases) >= 1
    for name, path in cases.items():
        exp = load_config(str(path))
        assert exp.name == name and exp.cluster is not None
        entry = published[name]
        assert entry["source"] and (entry["published"] or entry["stages"]["per_stage"])
        other = (entry.get("ranking") or {}).get("above")
        assert other is None or other in cases
