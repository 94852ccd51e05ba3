"""The CPU-checkable parts of the 2-GPU benchmark ``benchmarks/tp_gpu.py``: its arguments and its
report from partial results (the measurements need 2 GPUs and torchrun)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tp_gpu


def _route(ms: float, speedup: float = 1.0) -> dict:
    return {"ms_per_token": ms, "tokens_per_pass": 3.0, "speedup": speedup}


PARTIAL = [
    {},
    {"tp1": {"plain": _route(10.0)}},
    {"tp1": {"plain": _route(10.0)}, "tp2": {"plain": _route(5.5), "chain_p1.0_L8": _route(1.5, 3.7)}},
    {"tp2": {"plain": _route(5.5), "chain_p0.8_L8": _route(3.0, 1.8)}, "plans": {"gathered_ms": 4.0}},
    {"plans": {"gathered_ms": 4.0, "heads_ms": 3.1}, "exact_fp32": {"gathered_plain": "16/16", "heads_chain_p0.8_L8": "15/16"}},
]


@pytest.mark.parametrize("results", PARTIAL)
def test_targets_from_partial_results(results):
    targets = {t["name"]: t for t in tp_gpu.targets(results)}
    assert list(targets) == [name for name, _ in tp_gpu.TARGETS]  # what a run did not reach is listed too
    ratio = targets["plain graphed decoding, 9B shape: TP=2 ms/token over TP=1"]
    assert ratio["measured"] == (0.55 if "tp1" in results and "tp2" in results else None)
    assert ratio["met"] == (ratio["measured"] is not None)
    chain = targets["oracle chain p=0.8 L=8 at TP=2, over graphed plain decoding at TP=2"]
    assert (chain["measured"], chain["met"]) == ((1.8, False) if "chain_p0.8_L8" in results.get("tp2", {}) else (None, False))
    plans = targets["head-sharded GDN plan over the gathered plan, one verify pass"]
    assert (plans["measured"], plans["met"]) == ((0.775, True) if "heads_ms" in results.get("plans", {}) else (None, False))
    exact = targets["greedy output at TP=2 identical to TP=1 (fp32, 16 prompts x 64 tokens)"]
    assert (exact["measured"], exact["met"]) == (("31/32", False) if "exact_fp32" in results else (None, False))


def test_report_files_from_partial_results(tmp_path):
    profile = {"kernels_per_pass": 900.0, "by_kind_ms": {"gemm": 2.5, "collective": 1.9}, "busy_ms": 4.4, "span_ms": 5.1}
    results = {**PARTIAL[2], "world": 2, "errors": {"plans": "Traceback ...\nRuntimeError: NCCL error"},
               "plans": {"gathered_ms": 7.3, "gathered_profile": profile, "heads_plain_step": {"ms": 4.25, "profile": profile}},
               "tp1_profile_1": {**profile, "kernels_per_pass": 600.0}}
    tp_gpu.main(["--plot", str(_write(tmp_path / "in.json", results)), "--out", str(tmp_path / "out")])
    written = json.loads((tmp_path / "out" / "tp_gpu.json").read_text())
    assert [t["measured"] for t in written["targets"]] == [None, 0.55, None, None]
    table = (tmp_path / "out" / "tp_gpu.md").read_text()
    assert "| plain graphed decoding, 9B shape: TP=2 ms/token over TP=1 | 0.55 | <= 0.6 | yes |" in table
    assert "| TP=2 | chain_p1.0_L8 | 1.500 | 3.00 | 3.70 | - |" in table
    assert "Section `plans` failed: `RuntimeError: NCCL error`" in table
    assert "| TP=1 | - | 600 | 4.400 | 5.100 |" in table  # the 1-node passes: TP=1 first, then each plan
    assert "| TP=2, heads plan | 4.250 | 900 | 4.400 | 5.100 |" in table
    assert "gathered plan: 7.300" in table and "- gathered plan, rank 0: 900 kernels, by kind (ms) {'gemm': 2.5, 'collective': 1.9}" in table


def _write(path: Path, results: dict) -> Path:
    path.write_text(json.dumps(results))
    return path


def test_arguments():
    args = tp_gpu.parse_args([])
    assert (args.sections, args.layers, args.exact_layers, args.exact_prompts, args.exact_tokens) == (list(tp_gpu.SECTIONS), None, 4, 16, 64)
    assert tp_gpu.parse_args(["--sections", "tp2", "plans", "--layers", "8"]).sections == ["tp2", "plans"]
    assert (args.plan, tp_gpu.parse_args(["--plan", "heads"]).plan) == ("gathered", "heads")
    for bad in (["--layers", "6"], ["--exact-layers", "0"], ["--sections", "eager"], ["--plan", "rows"]):
        with pytest.raises(SystemExit):
            tp_gpu.parse_args(bad)


def test_without_gpus_it_says_how_to_launch(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(SystemExit, match="torchrun --nproc-per-node 2"):
        tp_gpu.main(["--sections", "tp2"])
