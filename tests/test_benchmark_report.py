"""The GPU benchmark's report (targets, markdown, plot) from partial results: a section that stopped
early must still leave a readable report (CPU; the benchmark itself needs a GPU)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import e2e_gpu  # noqa: E402


def _route(speedup: float) -> dict:
    return {"speedup": speedup, "tokens_per_pass": 3.0}


PARTIAL = [
    {},
    {"fla_b1": {"plain": {"ms_per_token": 0.9}}},
    {"fla_b1": {"plain": {"ms_per_token": 3.4}, "pass_ms": {"1": 2.9, "16": 3.1}}},
    {"fla_b1": {"plain": {"ms_per_token": 3.4}, "pass_ms": {"1": 2.9, "16": 3.1}, "chain": {"L12_p1.0": _route(7.0), "L8_p0.6": _route(1.2)}}},
    {"qwen": {"p1.0_L8": _route(4.5)}, "exact_fp32": {"fla_chain": "16/16", "qwen_chain": "15/16"}},
]


@pytest.mark.parametrize("results", PARTIAL)
def test_targets_from_partial_results(results):
    targets = {t["name"]: t for t in e2e_gpu.targets(results)}
    assert set(targets) == {name for name, _ in e2e_gpu.ALL_TARGETS}  # what a run did not reach is listed too
    b1 = results.get("fla_b1", {})
    plain = targets["plain graphed decoding, ms/token"]
    assert (plain["measured"] is None) == ("plain" not in b1)
    if "plain" in b1:
        assert plain["met"] == (b1["plain"]["ms_per_token"] <= 1.0)
    assert targets["verify pass over plain step, tree of 32"]["measured"] is None  # no 32-node pass was timed
    if "chain" in b1:
        assert targets["oracle chain L=12 p=1.0 speedup"]["met"] and not targets["p=0.6 best L speedup"]["met"]
        assert targets["p=0.8 L=8 speedup"]["measured"] is None
    if "exact_fp32" in results:
        assert not targets["fp32 greedy identical to graphed plain decoding (4-layer models)"]["met"]
    assert not any(t["met"] for t in targets.values() if t["measured"] is None)


def test_report_files_from_a_partial_heatmap(tmp_path):
    pytest.importorskip("matplotlib")
    e2e_gpu.write_report(dict(PARTIAL[3]), str(tmp_path))
    written = json.loads((tmp_path / "e2e_gpu.json").read_text())
    assert [t["name"] for t in written["targets"]][:2] == ["plain graphed decoding, ms/token", "verify pass over plain step, chain of 9 (16-node bucket)"]
    table = (tmp_path / "e2e_gpu.md").read_text()
    assert "| 12 | - | - | - | - | - | 7.00 |" in table
    assert (tmp_path / "e2e_gpu.png").stat().st_size > 0
