"""The GPU benchmark's report (targets, markdown, plot) from partial results: a section that stopped
early must still leave a readable report (CPU; the benchmark itself needs a GPU)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import e2e_gpu
import pytest
import torch


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
    targets = {t["name"].removesuffix(" (16-node bucket)"): t for t in e2e_gpu.targets(results)}  # (the chain's)
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


@pytest.mark.parametrize("cold_hits", [0, 2])
def test_warm_start_times_a_child_on_empty_caches_then_one_on_the_caches_it_filled(cold_hits, monkeypatch):
    """Both children get the same inductor and Triton cache folders, new to this call; the first one's time is
    the cold start only when it hit no on-disk cache (inductor's in-process ``async_compile_cache`` hits, which
    a cold process has by the dozen, do not count)."""
    envs, outputs = [], iter([(80.0, cold_hits), (12.0, 3)])

    def child(command, env, **_):
        envs.append(env)
        seconds, hits = next(outputs)
        caches = {"fxgraph_cache_hit": hits, "async_compile_cache_hit": 63, "fxgraph_cache_miss": 6}
        line = json.dumps({"warm_start_s": seconds, "compile_caches": caches})
        return argparse.Namespace(stdout=f"compiling...\n{line}\n", stderr="")

    monkeypatch.setattr(e2e_gpu.subprocess, "run", child)
    results = {}
    e2e_gpu.warm_start(argparse.Namespace(child=False, layers=None, inductor=[], backend=[]), results)
    folders = [(env["TORCHINDUCTOR_CACHE_DIR"], env["TRITON_CACHE_DIR"]) for env in envs]
    assert len(folders) == 2 and folders[0] == folders[1] and not Path(folders[0][0]).parent.exists()  # (removed after)
    targets = {t["name"]: t for t in e2e_gpu.targets(results)}
    assert targets["second process, warm cache, AR step + 3 buckets, s"]["measured"] == 12.0
    assert results["warm_start"]["cold_child"]["warm_start_s"] == 80.0
    assert targets["cold start, AR step + 3 buckets, s"]["measured"] == (None if cold_hits else 80.0)


def test_fold_ab_runs_fla_passes_in_a_child_per_option_set_and_tables_the_ratios(tmp_path, monkeypatch):
    """Each option set of ``FOLD_AB`` is one child ``fla_passes`` with ``--backend``'s options first, then its own;
    the table divides each by the defaults' figures and says whether its plain tokens were the defaults', and a child
    that timed nothing is reported, not dropped."""
    commands = []

    def child(command, **_):
        commands.append(command)
        options = command[command.index("--backend") + 1 :] if "--backend" in command else []
        out = command[command.index("--out") + 1]
        if "fold_convs=True" in options and len(options) == 2:  # (the fold_convs child fails)
            return argparse.Namespace(stdout="", stderr="Traceback: boom")
        speed = 1.1 if "fold_swiglu=False" in options else 1.0
        passes = {"plain_ms_per_token": 1.5 * speed, "plain_tokens_sha1": "ab" if len(options) < 3 else "cd",
                  "pass_ms": {"1": 1.4 * speed, "9": 1.7, "16": 1.75},
                  "pass_ms_tree": {"16": 1.75, "32": 2.0}, "profile_1": {"kernels_per_pass": 258.0, "busy_ms": 1.2 * speed, "span_ms": 1.3,
                                                                "by_kind_ms": {"gemm": 0.8 * speed, "inductor": 0.3}, "one_layer": []},
                  "profile_16_tree": {"kernels_per_pass": 300.0, "busy_ms": 1.6, "span_ms": 1.7,
                                      "by_kind_ms": {"gemm": 0.9, "recurrence": 0.25 * speed}, "one_layer": [["k", 1.0]]}}
        Path(out, "e2e_gpu.json").write_text(json.dumps({"fla_passes": passes}))
        return argparse.Namespace(stdout="", stderr="")

    monkeypatch.setattr(e2e_gpu.subprocess, "run", child)
    results = {}
    args = argparse.Namespace(layers=None, prompts=4, backend=["regional=True"], out=str(tmp_path), ab_sets=None)
    e2e_gpu.fold_ab(args, results)
    assert len(commands) == len(e2e_gpu.FOLD_AB)
    assert all(c[c.index("--backend") + 1] == "regional=True" for c in commands)
    assert results["fold_ab"]["fold_convs"]["error"].endswith("boom")
    table = (tmp_path / "e2e_gpu.md").read_text()
    assert "| without_fold_swiglu | 1.650 (1.100) | 1.540 (1.100) | 1.700 (1.000) | 1.750 (1.000) | 1.750 (1.000) | 2.000 (1.000) | 258.0 | yes |" in table
    assert "| fold_convs | failed: see the JSON |" in table and "| 258.0 | no |" in table  # (both)
    assert "| gemm | 0.800 | 0.880 |" in table and "| busy (sum of kernels) | 1.200 | 1.320 |" in table  # (a column a set)
    assert "Of the 16-node tree pass, an option set a column:" in table and "| recurrence | 0.250 | 0.275 |" in table
    assert "one_layer" not in results["fold_ab"]["defaults"]["profile_1"]
    assert "one_layer" not in results["fold_ab"]["defaults"]["profile_16_tree"]


def test_sampling_section_reaches_the_report(tmp_path):
    """``fla_sampling``'s sampled chains are tabled against plain sampling; a section cut before its first chain
    leaves its plain figures, and one that timed nothing adds no table."""
    section = {"sampling": e2e_gpu.SAMPLING, "greedy_plain_ms_per_token": 1.46, "plain_ms_per_token": 1.62,
               "p1.0_L8": {"ms_per_token": 0.25, "tokens_per_pass": 8.6, "speedup": 6.48}}
    e2e_gpu.write_report({"fla_sampling": section}, str(tmp_path))
    table = (tmp_path / "e2e_gpu.md").read_text()
    assert "plain sampling 1.620 ms/token (greedy plain decoding 1.460)" in table
    assert "| oracle chain L=8, p=1.0 | 0.250 | 8.60 | 6.48x |" in table and "oracle chain L=8, p=0.8" not in table
    assert e2e_gpu.fla_sampling_markdown({"sampling": e2e_gpu.SAMPLING}) == []


def test_plain_target_is_the_b1_run_else_the_profile_run_and_operators_reach_the_report(tmp_path):
    """The headline plain figure is ``fla_b1``'s (warmed up in its own process), ``fla_profile``'s when
    there is none; ``fla_profile``'s operator table (``aten::`` and ``specla::`` rows only) is written
    under the kernel profile."""
    ops = [{"op": "aten::copy_", "shapes": "[[1, 8, 256, 256]]", "calls": 48, "device_ms": 0.235},
           {"op": "nvjet_sm90_gemm", "shapes": "[]", "calls": 24, "device_ms": 0.3}]
    results = {"fla_b1": {"plain": {"ms_per_token": 0.95}},
               "fla_profile": {"plain": {"ms_per_token": 2.8}, "op_profile": {"1_chain": ops},
                               "replay": {"1_chain": {"launch_ms": 0.006, "wall_ms_per_replay": 2.3}}}}
    for section, figure, met in (("fla_b1", 0.95, True), ("fla_profile", 2.8, False)):
        plain = {t["name"]: t for t in e2e_gpu.targets(results)}["plain graphed decoding, ms/token"]
        assert (plain["measured"], plain["met"]) == (figure, met), section
        results["fla_b1"] = {}
    results["fla_b1"] = {"plain": {"ms_per_token": 0.95}}
    e2e_gpu.write_report(results, str(tmp_path))
    table = (tmp_path / "e2e_gpu.md").read_text()
    assert "| `aten::copy_` | [[1, 8, 256, 256]] | 48 | 0.235 |" in table and "nvjet" not in table
    assert "launch 0.006 ms of host time, 2.300 ms per back-to-back replay" in table


def test_the_chain_of_9_target_takes_a_9_node_bucket_where_one_was_timed():
    """The issue's chain of 9 nodes: its pass in a bucket of 9 where fla_passes timed one, else in the default
    bucket of 16 nodes, the bucket named either way; unmeasured, it is listed as not measured."""
    def chain_target(results):
        return next(t for t in e2e_gpu.targets(results) if "chain of 9" in t["name"])

    passes = {"pass_ms": {"1": 1.3, "16": 1.7, "9": 1.6}}
    found = chain_target({"fla_passes": passes})
    assert found["name"].endswith("chain of 9 (9-node bucket)") and found["measured"] == round(1.6 / 1.3, 3)
    assert found["met"] is True
    del passes["pass_ms"]["9"]
    found = chain_target({"fla_passes": passes})
    assert found["name"].endswith("chain of 9 (16-node bucket)") and found["met"] is False
    assert chain_target({})["measured"] is None


def test_fla_passes_profiles_are_tabled_a_pass_a_column(tmp_path):
    """``fla_passes``' kernel profiles (1-node, 9-node chain, 16-node tree) reach the report side by side, so the
    chain-of-9 ratio can be read against what each pass spends."""
    def profile(gemm, kernels):
        return {"kernels_per_pass": kernels, "busy_ms": gemm + 0.5, "span_ms": gemm + 0.3, "by_kind_ms": {"gemm": gemm}}

    passes = {"pass_ms": {"1": 1.3, "9": 1.7}, "profile_1": profile(1.0, 210.0), "profile_9": profile(1.1, 300.0)}
    e2e_gpu.write_report({"fla_passes": passes}, str(tmp_path))
    table = (tmp_path / "e2e_gpu.md").read_text()
    assert "| | the 1-node pass | the 9-node chain pass |" in table and "| gemm | 1.000 | 1.100 |" in table
    assert "| kernels | 210 | 300 |" in table and "the 16-node tree pass" not in table


def test_report_files_from_a_partial_heatmap(tmp_path):
    pytest.importorskip("matplotlib")
    e2e_gpu.write_report(dict(PARTIAL[3]), str(tmp_path))
    written = json.loads((tmp_path / "e2e_gpu.json").read_text())
    assert [t["name"] for t in written["targets"]][:2] == ["plain graphed decoding, ms/token", "verify pass over plain step, chain of 9 (16-node bucket)"]
    table = (tmp_path / "e2e_gpu.md").read_text()
    assert "| 12 | - | - | - | - | - | 7.00 |" in table
    assert (tmp_path / "e2e_gpu.png").stat().st_size > 0


def test_kernel_summary_counts_time_and_calls_per_replay():
    """Two replays of a pass of five kernels (a GEMM, two copies, an inductor kernel whose name holds
    ``_to_copy``: not a copy, an NCCL collective), as the profiler's chrome trace lists them, among CPU events that do not count."""
    def kernel(name, ts, dur):
        return {"cat": "kernel", "name": name, "ts": ts, "dur": dur}

    events = [{"cat": "cpu_op", "name": "aten::copy_", "ts": 0, "dur": 500}]
    for start in (0, 1000):
        events += [kernel("nvjet_sm90_gemm", start, 300), kernel("elementwise_kernel copy", start + 300, 20),
                   {"cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": start + 400, "dur": 10},
                   kernel("triton_poi_fused__to_copy_add_0", start + 410, 40),
                   kernel("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", start + 450, 15)]
    summary = e2e_gpu.summarize_kernels(events, replays=2)
    assert summary["kernels_per_pass"] == 5
    assert summary["busy_ms"] == pytest.approx(0.385)
    assert summary["span_ms"] == pytest.approx(1.465 / 2)  # 0 to 1465 us over two replays: gaps included
    assert summary["by_kind_ms"] == {"gemm": 0.3, "inductor": 0.04, "copy": 0.03, "collective": 0.015}
    assert summary["top_kernels_calls"] == {"nvjet_sm90_gemm": 1, "triton_poi_fused__to_copy_add_0": 1,
                                            "elementwise_kernel copy": 1, "ncclDevKernel_AllReduce_Sum_bf16_RING_LL": 1,
                                            "Memcpy DtoD": 1}


def test_the_critical_path_counts_what_each_kernel_adds_to_the_span():
    """Under PDL a kernel starts before the one before it ends and waits (its duration counts the wait): the critical
    path gives each kernel only its end past every end before it, so that the kinds sum to the span of each replay
    (the gap between replays not counted), and the report tables it under the kernels' time."""
    def kernel(name, ts, dur):
        return {"cat": "kernel", "name": name, "ts": ts, "dur": dur}

    events = []
    for start in (0, 100):  # a GEMM, a norm launched early (ends 4 us after it), a conv inside the norm's time
        events += [kernel("nvjet_gemm", start, 10), kernel("triton_red_norm", start + 2, 12),
                   kernel("_three_tree_convs_kernel", start + 5, 3), kernel("nvjet_gemm", start + 14, 6)]
    summary = e2e_gpu.summarize_kernels(events, replays=2)
    assert summary["by_kind_ms"] == {"gemm": 0.016, "inductor": 0.012, "conv": 0.003}
    assert summary["critical_by_kind_ms"] == {"gemm": 0.016, "inductor": 0.004, "conv": 0.0}
    assert sum(summary["critical_by_kind_ms"].values()) == pytest.approx(0.020)  # (0 to 20 us, each replay)
    uneven = e2e_gpu.summarize_kernels([*events, {"cat": "gpu_memset", "name": "Memset", "ts": 21, "dur": 1}], replays=2)
    # (a stray memset 1 us after the first replay adds its 2 us there; the gap before the next replay still counts not)
    assert uneven["critical_by_kind_ms"] == {"gemm": 0.016, "inductor": 0.004, "copy": 0.001, "conv": 0.0}
    lines = e2e_gpu.profile_markdown({"1_chain": summary}, 0.7)
    assert "| inductor, on the critical path | 0.004 |" in lines and "| inductor | 0.012 |" in lines
    events.append(kernel("_recurrent_kernel", 200, 2))  # (a layer: from one recurrence kernel to the next)
    events.insert(0, kernel("_recurrent_kernel", -2, 2))
    summary = e2e_gpu.summarize_kernels(events, replays=1)
    assert summary["one_layer_added_us"][:5] == [2, 10, 4, 0, 6]
    table = "\n".join(e2e_gpu.layer_markdown({"fla_b1": {"profile": {"1_chain": summary}}}))
    assert "| `triton_red_norm` | 12.00 | 4.00 |" in table


def test_one_layer_is_the_launch_order_from_one_recurrence_kernel_to_the_next(tmp_path):
    """The trace lists kernels out of order; ``one_layer`` is sorted by start time and spans one layer,
    and the report prints it under the operator table."""
    def kernel(name, ts):
        return {"cat": "kernel", "name": name, "ts": ts, "dur": 2.0}

    order = ["triton_red_norm", "_recurrent_kernel", "nvjet_gemm", "_tree_conv_kernel", "_recurrent_kernel", "nvjet_gemm"]
    events = [kernel(name, ts) for ts, name in reversed(list(enumerate(order)))]
    layer = e2e_gpu.summarize_kernels(events, replays=1)["one_layer"]
    assert [name for name, _ in layer] == ["_recurrent_kernel", "nvjet_gemm", "_tree_conv_kernel"]
    results = {"fla_profile": {"op_profile": {"1_chain": []}, "profile": {"1_chain": {"one_layer": layer}}}}
    e2e_gpu.write_report(results, str(tmp_path))
    assert "(`fla_profile`), kernels in launch order" in (tmp_path / "e2e_gpu.md").read_text()
    assert "3 kernels, 6.0 us of kernel time" in (tmp_path / "e2e_gpu.md").read_text()
    newer = {"one_layer": layer[:2], "by_kind_ms": {"gemm": 0.002}, "busy_ms": 0.004, "span_ms": 0.005, "kernels_per_pass": 2}
    results["fla_b1"] = {"profile": {"1_chain": newer}}  # a newer run's layer is the one printed
    e2e_gpu.write_report(results, str(tmp_path))
    assert "(`fla_b1`), kernels in launch order" in (tmp_path / "e2e_gpu.md").read_text()
    assert "2 kernels, 4.0 us of kernel time" in (tmp_path / "e2e_gpu.md").read_text()


@pytest.mark.parametrize("stop_on_error", [False, True])
def test_sections_after_a_failed_one_run_unless_told_to_stop(stop_on_error):
    """A failed section leaves its traceback in the report, written at once; with ``stop_on_error`` (the
    2-GPU benchmark: a failed rank cannot rejoin the next section's collectives) the error propagates."""
    ran, reports = [], []

    def fails(args, results):
        ran.append("fails")
        raise RuntimeError("CUDA error: device-side assert triggered")

    sections = {"first": lambda args, results: ran.append("first"), "fails": fails, "last": lambda args, results: ran.append("last")}
    args, results = argparse.Namespace(sections=["first", "fails", "last"]), {}

    def run():
        e2e_gpu.run_sections(args, results, sections, lambda: reports.append(dict(results)), stop_on_error=stop_on_error)

    if stop_on_error:
        with pytest.raises(RuntimeError, match="device-side assert"):
            run()
    else:
        run()
    assert ran == (["first", "fails"] if stop_on_error else ["first", "fails", "last"])
    assert len(reports) == len(ran) and "device-side assert" in reports[1]["errors"]["fails"]


def test_compile_start_report_and_arguments(tmp_path):
    """``compile_start_cpu.py``'s table from both processes' figures (the timing itself takes minutes)."""
    import compile_start_cpu

    run = {"1_node_s": 12.9, "16_node_s": 1.7, "total_s": 14.6, "dynamo_graphs": 1, "caches": {"fxgraph_cache_hit": 2}}
    results = {"layers": 24, "inner": "inductor", "torch": "2.x", "same_tokens": True,
               "whole graph": {"cold": {**run, "total_s": 68.4}, "warm": run}, "by layer": {"cold": {**run, "total_s": 30.2}, "warm": run}}
    compile_start_cpu.write_report(results, str(tmp_path))
    table = (tmp_path / "compile_start_cpu.md").read_text()
    assert "| whole graph | cold | 12.9 | 1.7 | 68.4 | 1 |" in table and "| by layer | cold | 12.9 | 1.7 | 30.2 | 1 |" in table
    assert "| whole graph | warm | 12.9 | 1.7 | 14.6 | 1 | {'fxgraph_cache_hit': 2} |" in table
    assert "Both ways emit the same tokens: True." in table
    assert json.loads((tmp_path / "compile_start_cpu.json").read_text())["whole graph"]["warm"]["total_s"] == 14.6
    assert compile_start_cpu.parse_args([]).layers == 24
    with pytest.raises(SystemExit):
        compile_start_cpu.parse_args(["--layers", "0"])


def test_eagle_kernel_count_of_a_tree_propose():
    """eagle_kernels_cpu.py lists the device calls of a compiled tree propose (depth 6): the head runs 6 times
    (the catch-up, whose newest pair scores level 0, then levels 1-5), each with its attention as a specla op and
    its GEMMs as the fused ops (the fuse with its table rows and o_proj with its residual, q/k/v and gate/up
    with their norms), so that only the down projection (too shallow here for specla's split kernel) is a GEMM of
    inductor's; each level's LM head and top-k are one specla op, and no aten.topk is left (the beam is picked by
    fused elementwise work)."""
    from eagle_kernels_cpu import CONFIGS, device_calls

    calls = device_calls(CONFIGS["tree_k4_d6_n16"])
    for op, per_head_call in (("draft_attention", 1), ("linear_top_k", 1), ("linear_add", 2), ("norm_linear", 1),
                              ("norm_gated_linear", 1), ("vocab_top_k", 0)):
        assert calls.count(f"torch.ops.specla.{op}") == 6 * per_head_call, op
    assert sum(c.startswith("extern_kernels.") for c in calls) == 6
    assert not any("topk" in c for c in calls)


def test_eagle_kernel_count_of_a_chain_propose():
    """The chain (L = 8) compiles too: one specla attention per head call (the catch-up and levels 1-7; the
    op's output shape is its memory layout: a transposed one made inductor's stride check fail, with two
    threads, as the benchmark runs, not with the tests' one) and no top-k (its levels take the argmax)."""
    from eagle_kernels_cpu import CONFIGS, device_calls

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        calls = device_calls(CONFIGS["chain_L8"])
    finally:
        torch.set_num_threads(threads)
    assert calls.count("torch.ops.specla.draft_attention") == 8
    assert not any("top_k" in c or "topk" in c for c in calls)


def test_compile_phases_name_where_compile_time_went():
    """The warm-start child's breakdown: Dynamo's and inductor's timed phases of this process, the short ones
    left out."""
    torch._dynamo.reset()
    torch.compile(lambda x: x.sin() + 1, backend="eager")(torch.randn(3))
    phases = e2e_gpu.compile_phases(at_least=0.0)
    assert "_compile.compile_inner" in phases and all(v >= 0 for v in phases.values())
    assert e2e_gpu.compile_phases(at_least=1e9) == {}


@pytest.mark.parametrize("top_k", [1, 3])
def test_oracle_drafts_follow_the_truth_with_the_controlled_acceptance(top_k):
    """Figure 12's controlled drafts: node 0 the row's pending token; per depth the chain node holds the true
    token with probability p, and each sibling in turn with probability p once none before it did."""
    from specla_compile.runtime.drafting import DraftRequest
    from specla_compile.runtime.topology import depth as node_depth

    rows, p, depth, prompt = 64, 0.7, 4, 5
    truth = [torch.randint(0, 1000, (40,)).tolist() for _ in range(rows)]
    drafter = e2e_gpu.OracleDrafter(truth, p, depth, top_k, vocab=1000, seed=1)
    drafter.begin([torch.zeros(prompt, dtype=torch.long)] * rows)
    done = 3  # tokens emitted so far, the pending one included
    sequences = [torch.tensor([0] * prompt + t[:done]) for t in truth]
    right = torch.zeros(depth, top_k)
    for _ in range(40):
        draft = drafter.propose(DraftRequest(list(range(rows)), sequences), None)
        assert draft.tokens.shape == (rows, 1 + depth * top_k)
        assert draft.tokens[:, 0].tolist() == [t[done - 1] for t in truth]
        assert node_depth(draft.parents)[0].tolist() == [0] + [d + 1 for d in range(depth) for _ in range(top_k)]
        assert all(q == 0 or (q - 1) % top_k == 0 for q in draft.parents[0, 1:].tolist())  # children of chain nodes only
        expected = torch.tensor([t[done : done + depth] for t in truth])
        right += (draft.tokens[:, 1:].view(rows, depth, top_k) == expected[..., None]).float().mean(0) / 40
    chance = torch.tensor([p * (1 - p) ** j for j in range(top_k)])  # the j-th candidate is the first right one
    torch.testing.assert_close(right, chance.expand(depth, -1), atol=0.03, rtol=0)


@pytest.mark.parametrize("top_k", [1, 2])
def test_the_oracle_drafts_on_the_device_in_step_with_the_passes(top_k):
    """The benchmark's oracle with ``device=True`` drafts every pass but the first from the pass before it
    (``propose_after``): at p = 1 its drafts hold the true continuation exactly where each row stands (every
    draft accepted, as many passes as the host-drafting oracle needs), and at p = 0.6 the output is still plain
    decoding's (tiny fla model on CPU, the static engine)."""
    from models import VOCAB, tiny_model

    from specla_compile import SpecConfig, SpeculativeGenerator

    model = tiny_model("fla")
    prompts = torch.randint(0, VOCAB, (3, 5), generator=torch.Generator().manual_seed(4))
    config = SpecConfig(mode="chain" if top_k == 1 else "tree", depth=3, tree_top_k=top_k, budget=3 * top_k, bucket=8,
                        engine="static")
    gen = SpeculativeGenerator(model, e2e_gpu.OracleDrafter([[0]], 1.0, 1), config, compile_options={"inner": "aot_eager"})
    plain = gen.decode(prompts, max_new_tokens=14).sequences
    truths = [row[5:].tolist() for row in plain]
    runs = {}
    for p in (1.0, 0.6):
        for device in (False, True):
            gen.drafter = drafter = e2e_gpu.OracleDrafter(truths, p, 3, top_k, vocab=VOCAB, seed=1, device=device)
            after = []
            real = drafter.propose_after
            drafter.propose_after = lambda *args: after.append(real(*args)) or after[-1]
            out = runs[p, device] = gen.generate(prompts, max_new_tokens=14)
            assert out.sequences.tolist() == plain.tolist(), (p, device)
            if device:  # (the host oracle says once that it cannot, and the generator stops asking)
                assert len(after) >= out.stats.iterations - 1 and all(d is not None for d in after)
            else:
                assert after == [None]
    assert runs[1.0, True].stats.iterations == runs[1.0, False].stats.iterations == 4  # 1 + 4 + 4 + 4 + 1 tokens
    assert runs[0.6, True].stats.iterations > 4


def test_a_call_ending_at_eos_with_a_pass_queued_behind_leaves_the_engine_exact():
    """With device drafts the next pass is queued before the host reads the one before; where every row then
    ends at EOS, that pass commits nothing: the call's tokens and final cache are plain decoding's with EOS,
    and the next call on the same engine is exact again."""
    from cache_utils import max_cache_diff
    from models import VOCAB, tiny_model

    from specla_compile import SpecConfig, SpeculativeGenerator
    from specla_compile.runtime.baseline import autoregressive_generate

    model = tiny_model("fla")
    prompt = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(9))
    config = SpecConfig(mode="chain", depth=3, bucket=4, engine="static")
    truth = autoregressive_generate(model, prompt, 30)[0][0, 5:].tolist()
    eos = truth[9]
    expected, expected_cache = autoregressive_generate(model, prompt, 30, eos_token_id=eos)
    assert len(expected[0]) - 5 < 30  # (EOS ends the row before its budget: 4 nodes a pass leave passes queued)
    drafter = e2e_gpu.OracleDrafter([truth], 1.0, 3, vocab=VOCAB, device=True)
    gen = SpeculativeGenerator(model, drafter, config, compile_options={"inner": "aot_eager"})
    out = gen.generate(prompt, max_new_tokens=30, eos_token_id=eos)
    assert out.sequences.tolist() == expected.tolist()
    assert max_cache_diff(out.past_key_values, expected_cache) <= 1e-5
    engine = next(iter(gen._engines.values()))
    assert len(engine.launched) == 1  # the pass queued behind the last one, never read
    assert out.stats.accepted_drafts == [3] * out.stats.iterations  # (what passes accepted, before the EOS cut)
    again = gen.generate(prompt, max_new_tokens=30)
    assert again.sequences[0].tolist() == prompt[0].tolist() + truth and not engine.launched


def test_target_train_speed_times_each_recurrence_variant_at_a_small_shape(tmp_path, monkeypatch):
    """The target-training benchmark on CPU at a tiny shape: every variant timed from the same weights and batch (so
    the same first loss: the variants change how the recurrence is computed, not what), the recurrence's share and
    the profile reported (the figures themselves come from the GPU)."""
    import target_train_speed

    results = target_train_speed.main(["--out", str(tmp_path), "--device", "cpu", "--num-layers", "2", "--hidden-size",
                                       "32", "--vocab-size", "64", "--batch-size", "2", "--seq-len", "16", "--warmup", "1",
                                       "--steps", "1", "--profile"])
    variants = results["variants"]
    assert list(variants) == list(target_train_speed.VARIANTS)
    first = variants["chunks_compiled"]["first_loss"]
    for r in variants.values():
        assert r["s_per_step"] > 0 and r["recurrence_s"] > 0 and r["first_loss"] == pytest.approx(first, rel=1e-4)
        assert r["last_loss"] < r["first_loss"]  # (two steps on one batch)
    profiled = variants["chunks_compiled"]["top_kernels"]
    kernels = profiled["top"]
    assert 0 < len(kernels) <= target_train_speed.PROFILE_ROWS and sum(k["share"] for k in kernels) <= 1 + 1e-9
    assert profiled["busy_s"] > 0 and profiled["kernels"] >= sum(k["calls"] for k in kernels)
    assert all(r["top_kernels"] is None for name, r in variants.items() if name != "chunks_compiled")
    report = (tmp_path / "target_train_speed.md").read_text()
    assert "| scan_compiled |" in report and "each layer recomputed" in report and "Most of the time of one step" in report
    with pytest.raises(SystemExit):
        target_train_speed.parse_args(["--out", str(tmp_path), "--device", "cpu", "--steps", "0"])

    def out_of_memory(args, variant, profile):
        if variant == "chunk_256":
            from torch._inductor.exc import InductorError
            raise InductorError(AssertionError("Unexpected tiling\nmore"), None)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    written = []  # the report after every variant (a call cut by its time limit keeps what it measured), and a
    # variant out of memory or failing to compile is reported as such while the others go on
    monkeypatch.setattr(target_train_speed, "write_report", lambda r, out, echo=True: written.append(dict(r["variants"])))
    monkeypatch.setattr(target_train_speed, "measure_variant", out_of_memory)
    target_train_speed.measure(target_train_speed.parse_args(["--out", str(tmp_path), "--device", "cpu"]))
    assert [list(w) for w in written] == [list(target_train_speed.VARIANTS)[:i] for i in range(1, len(target_train_speed.VARIANTS) + 1)]
    assert written[-1]["inverse"]["error"] == "out of memory: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert written[-1]["chunk_256"]["error"] == "compilation failed: AssertionError: Unexpected tiling"


def test_target_train_speed_recurrence_only_compares_each_variant_and_picks_the_fastest_that_agrees(tmp_path, monkeypatch):
    """--recurrence-only: one layer's recurrence per variant, its output and gradients against the first variant's
    (the variants agree; one made 2% wrong is caught), and --pick-within writes the fastest agreeing variant's
    train_target options, never a disagreeing one however fast."""
    import target_train_speed

    real = target_train_speed.chunked_gdn

    def wrong_inverse(*args, triangular="solve", **kwargs):  # the inverse variant 2% off, and the fastest
        o, state = real(*args, triangular=triangular, **kwargs)
        return (o * 1.02, state) if triangular == "inverse" else (o, state)

    monkeypatch.setattr(target_train_speed, "chunked_gdn", wrong_inverse)
    seconds = {"chunks_compiled": 3.0, "chunk_128": 2.0, "inverse": 1.0}
    real_median = target_train_speed.median_call
    calls = iter(["chunks_compiled", "chunk_128", "inverse"])
    monkeypatch.setattr(target_train_speed, "median_call",
                        lambda call, times: (real_median(call, times)[0], seconds[next(calls)]))
    results = target_train_speed.main(["--out", str(tmp_path), "--device", "cpu", "--num-layers", "4", "--batch-size",
                                       "2", "--seq-len", "16", "--steps", "1", "--recurrence-only", "--variants",
                                       "chunks_compiled", "chunk_128", "inverse", "--pick-within", "1e-3", "--profile"])
    variants = results["variants"]
    assert variants["chunks_compiled"]["difference"] == 0 and variants["chunk_128"]["difference"] < 1e-5
    assert variants["inverse"]["difference"] == pytest.approx(0.02, rel=1e-3)
    assert variants["chunk_128"]["recurrence_s"] == 4 * 2.0
    assert results["fastest"] == "chunk_128" and (tmp_path / "fastest_options.txt").read_text() == "--gdn-chunk 128\n"
    report = (tmp_path / "target_train_speed.md").read_text()
    assert variants["chunks_compiled"]["top_kernels"]["top"] and variants["inverse"]["top_kernels"] is None
    assert "Most of the time of one layer's recurrence, chunks_compiled (CPU self time" in report
    assert "| inverse | 1000.0 | 4.000 | 2.0e-02 | - |" in report and json.loads((tmp_path / "target_train_speed.json").read_text())["fastest"] == "chunk_128"
    with pytest.raises(SystemExit):
        target_train_speed.parse_args(["--out", str(tmp_path), "--pick-within", "1e-3"])  # (needs --recurrence-only)


def test_eagle_train_speed_times_each_head_precision_at_a_small_shape(tmp_path):
    """The head-training benchmark on CPU at a tiny shape: every precision timed, its loss finite, the report
    written (the figures themselves come from the H200)."""
    import eagle_train_speed

    results = eagle_train_speed.main(["--out", str(tmp_path), "--device", "cpu", "--layers", "1", "--hidden", "32",
                                      "--vocab", "64", "--batch-size", "2", "--seq-len", "8", "--warmup", "0",
                                      "--steps", "1", "--known-rows", "1"])
    variants = results["variants"]
    assert set(variants) == {"fp32", "bf16", "fp32, cached features", "bf16, cached features"}
    assert results["target_forward_ms"] > 0 and all(r["ms_per_step"] > 0 for r in variants.values())
    # bf16 autocast changes the head's numbers, not the batch: the two first losses are close but not equal;
    # cached features change nothing but where the features come from
    fp32, bf16 = variants["fp32"]["first_loss"], variants["bf16"]["first_loss"]
    assert fp32 != bf16 and abs(fp32 - bf16) < 0.05 * abs(fp32)
    assert variants["fp32, cached features"]["first_loss"] == pytest.approx(fp32, rel=1e-3)
    assert "| bf16, cached features |" in (tmp_path / "eagle_train_speed.md").read_text()
    with pytest.raises(SystemExit):
        eagle_train_speed.parse_args(["--out", str(tmp_path), "--device", "cpu", "--steps", "0"])
    with pytest.raises(SystemExit):
        eagle_train_speed.parse_args(["--out", str(tmp_path), "--device", "cpu", "--known-rows", "17"])


def test_cuda_gemv_report_from_partial_results(tmp_path):
    """The CUDA GEMV benchmark's markdown from a run cut after two shapes (one with a wrong configuration) and
    from a whole one with its layer table."""
    import gemv_cuda_gpu as G

    def timing(us: float, config: list | None = None) -> dict:
        return {"us": us, "TBps": 3.0, **({"config": config, "replay_matches": config[0] != 1} if config else {})}

    results = {"device": "test", "torch": "x", "triton": "y", "command": "python gemv_cuda_gpu.py", "layers": None, "shapes": {
        "qkvg": {"cublas": timing(11.5), "best_pdl0": timing(9.2, [2, 8, 0, 0]), "best_pdl1": timing(8.8, [2, 8, 1, 1]),
                 "configs": {}, "wrong_configs": []},
        "o_proj": {"cublas": timing(6.3), "best_pdl0": timing(4.1, [1, 8, 0, 0]), "configs": {},
                   "wrong_configs": [[8, 8, 0, 0, 0.7]]}}}
    G.write_report(results, str(tmp_path))
    text = (tmp_path / "gemv_cuda_gpu.md").read_text()
    assert "| qkvg [8208, 2048] | 11.50 | 3.00 | 9.20 | 3.00 | 0.800 | [2, 8, 0] | 8.80 | 3.00 | [2, 8, 1] |" in text
    assert "| o_proj [2048, 2048] | 6.30 | 3.00 | 4.10 | 3.00 | 0.651 | [1, 8, 0] | - | - | - |" in text
    assert "- o_proj: configurations whose output differs" in text and "One layer's" not in text
    assert "- o_proj: the captured graph of [1, 8, 0, 0] gave outputs other" in text and "qkvg: the captured" not in text
    results["layers"] = {side: {"ms_per_pass": ms, "us_per_layer": ms * 1000 / 24, "TBps": 3.0}
                         for side, ms in (("cublas", 1.04), ("cuda_gemv", 0.9), ("cuda_gemv_pdl", 0.8))}
    G.write_report(results, str(tmp_path))
    assert "| CUDA GEMV, PDL | 0.800 | 33.3 | 3.00 |" in (tmp_path / "gemv_cuda_gpu.md").read_text()
    side = {"us": 10.0, "TBps": 2.3, "matches": True}
    results["prologues"] = {"down_swiglu": {"before": side, "cuda_gemv": {**side, "us": 8.0}},
                            "o_proj_gated_norm": {"before": side, "cuda_gemv": {**side, "matches": False}},
                            "qkvg_add_norm": {"before": {**side, "us": 12.5}, "cuda_gemv": side,
                                              "cuda_gemv_best": {**side, "us": 9.0, "config": [1, 8, 1]}}}
    G.write_report(results, str(tmp_path))
    text = (tmp_path / "gemv_cuda_gpu.md").read_text()
    assert "| down with silu(gate) * up (fold's Triton GEMV) | 10.00 | 8.00 | 0.800 | - | - | yes |" in text
    assert ("| o_proj with the gated norm (fold's Triton GEMV) | 10.00 | 10.00 | 1.000 | - | - | no: its time does not "
            "count |") in text
    assert ("| q/k/v/gates with the add and norm (inductor's kernel, then the CUDA GEMV) | 12.50 | 10.00 | 0.800 | 9.00 "
            "| [1, 8, 1] | yes |") in text
    assert json.loads((tmp_path / "gemv_cuda_gpu.json").read_text())["layers"]["cublas"]["ms_per_pass"] == 1.04


def test_gated_norm_fold_report_from_partial_results(tmp_path):
    """fold_gpu's gated-norm table from partial results: the one-row GEMV's column only at one row, the best few-row
    configuration named, a row count whose configurations were all wrong or out of resources shown as dashes and
    the wrong ones listed; then the MLP product's table beside it, without that column."""
    import fold_gpu as F

    results = {"device": "test", "torch": "x", "triton": "y", "command": "python fold_gpu.py", "results": {},
               "gated_norm": {"1": {"unfolded_us": 10.0, "configs_us": {"default": 9.0, "16x4": 9.0, "32x8": 8.5,
                                                                        "gemv": 7.25}, "best": "32x8"},
                              "9": {"unfolded_us": 15.5, "configs_us": {"16x4": 8.0}, "best": "16x4",
                                    "wrong": [["default", 0.5]]},
                              "16": {"unfolded_us": 16.0, "configs_us": {}, "best": None}}}
    F.write_report(results, str(tmp_path))
    text = (tmp_path / "fold_gpu.md").read_text()
    assert "| 1 | 10.00 | 9.00 | 8.50 (32x8) | 7.25 |" in text and "| 9 | 15.50 | - | 8.00 (16x4) | - |" in text
    assert "| 16 | 16.00 | - | - | - |" in text and "{'9': [['default', 0.5]]}" in text
    results["swiglu_down"] = {"9": {"unfolded_us": 15.5, "configs_us": {"default": 12.0, "4x32x256": 11.25},
                                    "best": "4x32x256"}}
    F.write_report(results, str(tmp_path))
    assert "| 9 | 15.50 | 12.00 | 11.25 (4x32x256) |" in (tmp_path / "fold_gpu.md").read_text()


@pytest.mark.skipif(__import__("specla_compile.kernels.cuda_gemv").kernels.cuda_gemv.nvcc() is None, reason="needs nvcc")
def test_cuda_gemv_library_builds_and_refuses_shapes_it_has_no_instance_of(tmp_path):
    """The CUDA GEMV's source builds with nvcc for sm_90 and loads; without a GPU it can still refuse, before any
    CUDA call, a depth that is not a multiple of 256, a configuration too heavy in registers, a block of more than
    8 warps, an unknown prologue, gated-norm heads whose size is not a multiple of 8, an add and norm over less than
    the row or with no sum to write (-1)."""
    from specla_compile.kernels import cuda_gemv

    lib = cuda_gemv.build(str(tmp_path))

    def call(k: int, rows: int, warps: int, prologue: int, dim: int = 0, sum_out: int = 0) -> int:
        return lib.specla_gemv(0, 0, 0, 0, sum_out, 0, 64, k, rows, warps, 0, 0, prologue, dim, 0.0, 0, None)

    assert call(200, 1, 8, 0) == -1  # (K % 256)
    assert call(2048, 8, 8, 1) == -1  # (8 rows x 8 chunks: 64 > 32)
    assert call(1024, 1, 9, 0) == -1  # (warps)
    assert call(1024, 1, 8, 4) == -1  # (no such prologue)
    assert call(1024, 1, 8, 2, dim=12) == -1  # (heads of 12: not 8k)
    assert call(1024, 1, 8, 3, dim=256, sum_out=16) == -1  # (the add and norm's one head is the row)
    assert call(1024, 1, 8, 3, dim=1024) == -1  # (nowhere to write the sum)
    assert len(list(tmp_path.glob("cuda_gemv_*.so"))) == 1 and cuda_gemv.build(str(tmp_path)) is not None  # (built once)
    assert [cuda_gemv.config(*shape)[0] for shape in ((2048, 2048), (8208, 2048), (11264, 2048), (2048, 5632))] == [4, 2, 1, 1]
