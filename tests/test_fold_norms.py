"""A static twin's RMS norms fold into the GEMMs after them (with the residual add before them and the MLP's
``silu(gate) * up`` after): same results, fewer nodes, and generation through folded passes stays exact."""

from __future__ import annotations

import logging
import re
import time

import pytest
import torch
from models import VOCAB, tiny_model
from test_fuse_projections import _packed_fla_graph
from test_generator import COMPILE, OracleDrafter, plain

from specla_compile import SpecConfig, SpeculativeGenerator
from specla_compile.lowering import fold_norms as folding
from specla_compile.lowering.fuse_projections import fuse_projections, gathers_as_slices

SPECLA = torch.ops.specla
LAYERS = 4  # tiny_model's


def _calls_node(node: torch.fx.Node, *targets) -> bool:
    return node.op == "call_function" and node.target in targets


def _calls(gm: torch.fx.GraphModule, *targets) -> int:
    return sum(_calls_node(n, *targets) for n in gm.graph.nodes)


def _static_twin_graph(seed: int, fused: bool = True, tokens: int = 5) -> tuple[torch.fx.GraphModule, list]:
    gm, example_inputs = _packed_fla_graph(seed=seed, dynamic=False, tokens=tokens)
    if fused:
        fuse_projections(gm, example_inputs)
        gathers_as_slices(gm)
    return gm, example_inputs


def test_every_norm_of_a_packed_model_folds_and_the_outputs_stay():
    """Each layer's attention norm (with the add of the layer before, but the first's) and MLP norm (with the
    attention's residual add, and silu(gate) * up after its fused gate/up GEMM), and the final norm before the
    LM head (looked through ``logits_to_keep``'s whole slice), in fp32 on the CPU, where the ops run their
    PyTorch references."""
    gm, example_inputs = _static_twin_graph(seed=7)
    silus = _calls(gm, *folding.SILUS)
    with torch.no_grad():
        expected = gm(*example_inputs)
        assert folding.fold_norms(gm) == 0  # (float32: no kernel to fold into by default)
        assert folding.fold_norms(gm, dtypes=(torch.float32,)) == 2 * LAYERS + 1
        got = gm(*example_inputs)
    assert _calls(gm, *folding.NORMS) == 0 and _calls(gm, *folding.SILUS) == silus - LAYERS  # (gate/up's SiLUs went)
    assert _calls(gm, SPECLA.norm_linear.default) == 1  # the first layer's norm reads the embedding: no add
    assert _calls(gm, SPECLA.add_norm_linear.default) == LAYERS  # three attention norms and the final one
    assert _calls(gm, SPECLA.add_norm_gated_linear.default) == LAYERS
    assert all(n.meta.get("example_value") is not None for n in gm.graph.nodes if n.op == "call_function")
    for g, e in zip(got, expected):
        assert (g - e).abs().max() <= 1e-5 * e.abs().max()


def test_every_gemm_of_a_packed_model_routes_and_the_outputs_stay():
    """Without folding, each layer's four GEMMs (the fused q/k/v/gates, o_proj, the fused gate/up with silu(gate) *
    up, down) and the LM head become specla's linear ops, in fp32 on the CPU (their PyTorch references)."""
    gm, example_inputs = _static_twin_graph(seed=7)
    linears = sum(folding.linear_parts(n) is not None for n in gm.graph.nodes)
    with torch.no_grad():
        expected = gm(*example_inputs)
        assert folding.route_linears(gm) == 0  # (float32: no kernel to route to by default)
        assert folding.route_linears(gm, dtypes=(torch.float32,)) == linears == 4 * LAYERS + 1
        got = gm(*example_inputs)
    assert _calls(gm, SPECLA.linear.default) == 3 * LAYERS + 1 and _calls(gm, SPECLA.gated_linear.default) == LAYERS
    assert sum(folding.linear_parts(n) is not None for n in gm.graph.nodes) == 0
    assert all(n.meta.get("example_value") is not None for n in gm.graph.nodes if n.op == "call_function")
    for g, e in zip(got, expected):
        assert (g - e).abs().max() <= 1e-5 * e.abs().max()


def test_a_norm_that_several_gemms_read_stays():
    """Unpacked projections (fuse_projections off) read each norm in several GEMMs: only the final norm,
    which the LM head alone reads, folds; the rest stay composite ops."""
    gm, example_inputs = _static_twin_graph(seed=8, fused=False)
    with torch.no_grad():
        expected = gm(*example_inputs)
        assert folding.fold_norms(gm, dtypes=(torch.float32,)) == 1
        got = gm(*example_inputs)
    assert _calls(gm, *folding.NORMS) == 2 * LAYERS
    assert (got[0] - expected[0]).abs().max() <= 1e-5 * expected[0].abs().max()


def _decode_on_cpu_as_on_cuda(option: str, config: SpecConfig, seed: int, monkeypatch, caplog, **others: bool) -> str:
    """Drafted and plain decoding of a tiny fla model with the backend's ``option`` on (and ``others`` as given), made
    to apply on the CPU in fp32 (where the ops run their references), both checked against eager decoding; returns
    the log."""
    import specla_compile.backend as backend

    monkeypatch.setattr(backend, "_on_cuda", lambda inputs: True)
    monkeypatch.setattr(folding, "FOLDED_DTYPES", (torch.float32,))
    model = tiny_model("fla", seed=seed)
    prompt = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(seed + 4))
    expected = plain(model, prompt[0], 12)[0][0, 6:].tolist()
    gen = SpeculativeGenerator(model, OracleDrafter([expected + [0] * 16], error_rate=0.3, seed=seed), config,
                               compile_options={**COMPILE, option: True, **others})
    with caplog.at_level(logging.INFO, logger="specla_compile"):
        drafted = gen.generate(prompt, max_new_tokens=12).sequences[0, 6:].tolist()
        decoded = gen.decode(prompt, max_new_tokens=12).sequences[0, 6:].tolist()
    assert drafted == expected and decoded == expected
    return caplog.text


@pytest.mark.parametrize("config", [SpecConfig(mode="chain", depth=5, bucket=8),
                                    SpecConfig(mode="tree", depth=3, tree_top_k=2, budget=7, bucket=8)])
def test_generation_through_folded_passes_equals_plain_decoding(config, monkeypatch, caplog):
    """With ``fold_norms``, the backend folds the norms of each static twin of up to 32 tokens where the op has a
    kernel (CUDA, bf16): made to fold here (CPU, fp32), the tokens of drafted and plain decoding equal eager
    decoding's."""
    log = _decode_on_cpu_as_on_cuda("fold_norms", config, 5, monkeypatch, caplog)
    assert log.count(f"{2 * LAYERS + 1} norms folded") >= 2  # the draft bucket's twin and the 1-token loop's


def test_generation_through_routed_passes_equals_plain_decoding(monkeypatch, caplog):
    """With ``triton_linears`` (made to route here: CPU, fp32; the drafted MLPs' fold off, so that their down
    projections route too), the tokens of drafted and plain decoding equal eager decoding's."""
    log = _decode_on_cpu_as_on_cuda("triton_linears", SpecConfig(mode="chain", depth=5, bucket=8), 6, monkeypatch, caplog,
                                    fold_swiglu_drafted=False)
    assert f"{4 * LAYERS + 1} GEMMs routed" in log  # the draft bucket's twin
    assert f"{3 * LAYERS + 1} GEMMs routed" in log  # the 1-token loop's: its down projections in fold_swiglu's GEMV


def test_generation_through_cuda_gemvs_equals_plain_decoding(monkeypatch, caplog):
    """With ``cuda_gemvs`` (made to route here: CPU, fp32, where ``specla.row_gemv`` runs its reference), the tokens of
    drafted and plain decoding equal eager decoding's; the 1-token loop's GEMMs and folded down projections are
    routed, the draft bucket's twin keeps its own."""
    monkeypatch.setattr(folding.cuda_gemv, "weight_fits", lambda *args: True)
    monkeypatch.setattr(folding.cuda_gemv, "nvcc", lambda: "nvcc")  # (the option refuses to start without one)
    log = _decode_on_cpu_as_on_cuda("cuda_gemvs", SpecConfig(mode="chain", depth=5, bucket=8), 6, monkeypatch, caplog)
    assert log.count("GEMMs routed to the CUDA C GEMV") == 1
    # the attention norms but the first (of the embedding), the MLP norms and the final norm with the adds before them
    assert f"{2 * LAYERS} residual adds and norms folded into the CUDA C GEMV" in log
    assert f"{2 * LAYERS + 1} GEMMs routed to the CUDA C GEMV" in log  # the first q/k/v/gates, o_proj, down
    # regional compilation still shares one program between the middle layers (1 and 2 of 4): the embedding's norm,
    # layer 0, layers 1-2, layer 3 with the final norm and the head
    assert re.search(r"\(1,\)'s 5 regions: 4 compiled in [0-9.]+ s, 1 calling an earlier region's program", log)


@pytest.mark.parametrize("fold_norms", [False, True])
def test_every_gemm_of_a_folded_one_token_twin_routes_to_the_cuda_gemv_and_the_outputs_stay(fold_norms, monkeypatch):
    """After the one-token twin's folds, ``route_row_gemvs`` (made to route here: CPU, fp32) makes each layer's
    packed q/k/v/gates and gate/up GEMMs, its folded gated norm and o_proj, its folded down projection, and the LM
    head ``specla.row_gemv`` with the matching prologue, in fp32 on the CPU (the op's references): the outputs stay.
    ``fold_row_norms`` first folds every norm that follows a residual add, with its add, into
    ``specla.add_norm_row_gemv``: fla's fused prenorm before each MLP (the norm reads the float32 sum) and the add and
    norm before each later layer and the LM head (the norm reads the rounded sum); the first layer's norm stays."""
    monkeypatch.setattr(folding, "GEMV_BLOCK_K", 32)  # (the tiny model's 2 x 32 heads)
    monkeypatch.setattr(folding, "FOLDED_DTYPES", (torch.float32,))
    monkeypatch.setattr(folding.cuda_gemv, "weight_fits", lambda *args: True)
    gm, example_inputs = _static_twin_graph(seed=7, tokens=1)
    with torch.no_grad():
        expected = gm(*example_inputs)
        assert folding.fold_gated_norms(gm) == LAYERS
        assert folding.fold_swiglu(gm) == LAYERS
        if fold_norms:
            assert folding.fold_row_norms(gm) == 2 * LAYERS
        assert folding.route_row_gemvs(gm) == (2 * LAYERS + 1 if fold_norms else 4 * LAYERS + 1)
        got = gm(*example_inputs)
    prologues = [n.args[2] for n in gm.graph.nodes if _calls_node(n, SPECLA.row_gemv.default)]
    plain = 1 if fold_norms else 2 * LAYERS + 1
    assert {p: prologues.count(p) for p in set(prologues)} == {"none": plain, "swiglu": LAYERS, "gated_norm": LAYERS}
    folded = [n for n in gm.graph.nodes if _calls_node(n, SPECLA.add_norm_row_gemv.default)]
    assert sorted(n.args[5] for n in folded) == ([False] * LAYERS + [True] * LAYERS if fold_norms else [])
    # (each in its norm's module: a layer's input norm starts its region of the regional compile)
    modules = [list(n.meta["nn_module_stack"].values())[-1][0].rsplit(".", 1)[-1] for n in folded]
    assert sorted(modules) == (["attn_norm"] * (LAYERS - 1) + ["mlp_norm"] * LAYERS + ["norm"] if fold_norms else [])
    assert _calls(gm, *folding.NORMS) == (1 if fold_norms else 2 * LAYERS + 1)
    assert sum(folding.linear_parts(n) is not None for n in gm.graph.nodes) == 0
    for g, e in zip(got, expected):
        assert (g - e).abs().max() <= 1e-5 * e.abs().max()


def test_the_cuda_gemvs_fold_takes_the_weights_its_kernel_has_instances_for():
    """``cuda_gemv.weight_fits``, the fold's test on example values: bf16 weights of an instanced depth and rows as
    wide as the prologue reads; for the gated norm, heads of a multiple of 8 values and a bf16 norm weight of as many;
    for the add and norm, the row as one head."""
    weight, bf16 = torch.zeros(64, 2048, dtype=torch.bfloat16), torch.bfloat16
    norm = torch.zeros(256, dtype=bf16)
    assert folding.cuda_gemv.weight_fits(weight, bf16, 2048, "none")
    assert folding.cuda_gemv.weight_fits(weight, bf16, 4096, "swiglu")
    assert folding.cuda_gemv.weight_fits(weight, bf16, 2048, "gated_norm", 256, norm)
    assert not folding.cuda_gemv.weight_fits(weight, bf16, 4096, "none")  # (the row's width)
    assert not folding.cuda_gemv.weight_fits(weight, torch.float32, 2048, "none")  # (the row's dtype)
    assert not folding.cuda_gemv.weight_fits(torch.zeros(64, 1792, dtype=bf16), bf16, 1792, "none")  # (no K = 1792)
    assert not folding.cuda_gemv.weight_fits(weight.t().contiguous().t(), bf16, 2048, "none")  # (a column-major one)
    assert not folding.cuda_gemv.weight_fits(weight, bf16, 2048, "gated_norm", 12, torch.zeros(12, dtype=bf16))
    assert not folding.cuda_gemv.weight_fits(weight, bf16, 2048, "gated_norm", 256, norm.float())
    assert not folding.cuda_gemv.weight_fits(weight, bf16, 2048, "gated_norm")  # (no heads given)
    row_norm = torch.zeros(2048, dtype=bf16)
    assert folding.cuda_gemv.weight_fits(weight, bf16, 2048, "add_norm", 2048, row_norm)  # (one head: the row)
    assert not folding.cuda_gemv.weight_fits(weight, bf16, 2048, "add_norm", 256, norm)
    assert not folding.cuda_gemv.weight_fits(weight, bf16, 2048, "add_norm", 2048, row_norm[:1024])


def test_cuda_gemvs_build_the_gemv_once_in_the_background_and_its_failure_is_raised_where_it_is_used(monkeypatch, caplog):
    """With ``cuda_gemvs`` on a CUDA machine the backend starts the library's build in a thread (nvcc's half minute
    beside the twins' compilation), once however many graphs it compiles; every later call of ``library()`` waits for
    that one build. A build that fails in the thread is logged there, raised by the launch's own call, and not tried
    again (every graph would wait another half minute)."""
    from specla_compile import backend

    builds, started = [], []
    monkeypatch.setattr(folding.cuda_gemv, "_built", [])
    monkeypatch.setattr(folding.cuda_gemv, "_failed", [])
    monkeypatch.setattr(folding.cuda_gemv, "_prebuilding", [])
    monkeypatch.setattr(folding.cuda_gemv, "build", lambda: (time.sleep(0.2), builds.append(1), "library")[-1])
    monkeypatch.setattr(folding.cuda_gemv, "nvcc", lambda: "nvcc")
    monkeypatch.setattr(backend.torch.cuda, "is_available", lambda: True)
    prebuild = folding.cuda_gemv.prebuild
    monkeypatch.setattr(folding.cuda_gemv, "prebuild", lambda: started.append(prebuild()))
    linear = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    for _ in range(2):  # (two graphs: one build)
        backend.specla_backend(linear, [torch.randn(1, 2)], options={"inner": "eager", "cuda_gemvs": True})
    assert started[0] is not None and started[1] is None
    assert folding.cuda_gemv.library() == folding.cuda_gemv.library() == "library"
    started[0].join()
    assert builds == [1] and prebuild() is None  # (one build, the thread's or the first call's; none once built)

    def fail():
        builds.append("failed")
        raise RuntimeError("nvcc: no such architecture")

    monkeypatch.setattr(folding.cuda_gemv, "_built", [])
    monkeypatch.setattr(folding.cuda_gemv, "build", fail)
    with caplog.at_level(logging.WARNING, logger="specla_compile"):
        prebuild().join()
    assert "building the CUDA GEMV in the background failed: nvcc: no such architecture" in caplog.text
    for _ in range(2):
        with pytest.raises(RuntimeError, match="failed earlier in this process: nvcc: no such architecture"):
            folding.cuda_gemv.library()
    assert builds == [1, "failed"] and prebuild() is None  # (not tried again)


def test_cuda_gemvs_without_nvcc_fail_before_compiling(monkeypatch):
    import specla_compile.backend as backend

    monkeypatch.setattr(folding.cuda_gemv, "nvcc", lambda: None)
    with pytest.raises(ValueError, match="'cuda_gemvs' builds its GEMV with nvcc"):
        backend.specla_backend(None, [], options={"cuda_gemvs": True})


def test_every_gated_output_norm_folds_into_its_o_proj_and_the_outputs_stay(monkeypatch):
    """In a one-token twin, each layer's gated output norm, read by the reshape of its heads and o_proj alone,
    becomes one ``specla.gated_norm_linear``, in fp32 on the CPU (its PyTorch reference); not where the heads do not
    fill the kernel's K chunks, nor where something else reads the norm. (The backend folds one-token twins alone.)"""
    monkeypatch.setattr(folding, "GEMV_BLOCK_K", 32)  # (the tiny model's 2 x 32 heads; the 1.3B shape's are 8 x 256)
    gm, example_inputs = _static_twin_graph(seed=7, tokens=1)
    o_projs = sum(folding.linear_parts(n) is not None for n in gm.graph.nodes)
    with torch.no_grad():
        expected = gm(*example_inputs)
        assert folding.fold_gated_norms(gm) == 0  # (float32: no kernel to fold into by default)
        assert folding.fold_gated_norms(gm, dtypes=(torch.float32,)) == LAYERS
        got = gm(*example_inputs)
    assert _calls(gm, *folding.GATED_NORMS) == 0 and _calls(gm, SPECLA.gated_norm_linear.default) == LAYERS
    assert sum(folding.linear_parts(n) is not None for n in gm.graph.nodes) == o_projs - LAYERS
    assert all(n.meta.get("example_value") is not None for n in gm.graph.nodes if n.op == "call_function")
    for g, e in zip(got, expected):
        assert (g - e).abs().max() <= 1e-5 * e.abs().max()
    monkeypatch.setattr(folding, "GEMV_BLOCK_K", 128)
    assert folding.fold_gated_norms(_static_twin_graph(seed=7, tokens=1)[0], dtypes=(torch.float32,)) == 0
    monkeypatch.setattr(folding, "GEMV_BLOCK_K", 32)
    gm, _ = _static_twin_graph(seed=7, tokens=1)
    first = next(n for n in gm.graph.nodes if _calls_node(n, *folding.GATED_NORMS))
    with gm.graph.inserting_after(first):
        gm.graph.call_function(torch.neg, (first,))  # (a second reader)
    assert folding.fold_gated_norms(gm, dtypes=(torch.float32,)) == LAYERS - 1


def test_the_gated_output_norms_of_a_drafted_twin_fold_where_the_few_row_kernel_takes_them(monkeypatch):
    """In a twin of 5 rows, each layer's gated output norm and o_proj become one ``specla.gated_norm_linear`` where
    its few-row kernel takes the heads (the tiny model's 4 x 16), in fp32 on the CPU (its PyTorch reference), the
    outputs unchanged; not as a one-row twin (the one-row GEMV takes no such heads), nor in a twin of 33 rows (more
    than the kernel takes), nor for heads it does not take."""
    gm, example_inputs = _static_twin_graph(seed=7, tokens=5)
    with torch.no_grad():
        expected = gm(*example_inputs)
        assert folding.fold_gated_norms(gm, dtypes=(torch.float32,)) == 0  # (the one-row GEMV's K chunks: not filled)
        assert folding.fold_gated_norms(gm, dtypes=(torch.float32,), rows=5) == LAYERS
        got = gm(*example_inputs)
    assert _calls(gm, *folding.GATED_NORMS) == 0 and _calls(gm, SPECLA.gated_norm_linear.default) == LAYERS
    for g, e in zip(got, expected):
        assert (g - e).abs().max() <= 1e-5 * e.abs().max()
    assert folding.fold_gated_norms(_static_twin_graph(seed=7, tokens=33)[0], dtypes=(torch.float32,), rows=33) == 0
    monkeypatch.setattr(folding.ops, "GATED_NORM_ROWS_DIMS", (32, 64))
    assert folding.fold_gated_norms(_static_twin_graph(seed=7, tokens=5)[0], dtypes=(torch.float32,), rows=5) == 0


def test_plain_decoding_through_folded_gated_norms_equals_eager_decoding(monkeypatch, caplog):
    """With ``fold_gated_norms`` (made to fold here: CPU, fp32), the one-token twin of plain decoding folds each
    layer's gated norm into its o_proj while the drafted passes' twins keep theirs; drafted and plain decoding
    both equal eager decoding."""
    monkeypatch.setattr(folding, "GEMV_BLOCK_K", 32)  # (the tiny model's 2 x 32 heads)
    log = _decode_on_cpu_as_on_cuda("fold_gated_norms", SpecConfig(mode="chain", depth=5, bucket=8), 4, monkeypatch, caplog)
    assert log.count(f"{LAYERS} gated norms folded") == 1  # the 1-token twin's, not the draft bucket's


def test_drafted_decoding_through_folded_gated_norms_equals_eager_decoding(monkeypatch, caplog):
    """With ``fold_gated_norms_drafted`` (made to fold here: CPU, fp32), the draft bucket's twin folds each layer's
    gated norm into its o_proj (the few-row kernel's heads) while the one-token twin keeps its own (the tiny model's
    heads fill no K chunk of the one-row kernel); drafted and plain decoding both equal eager decoding."""
    log = _decode_on_cpu_as_on_cuda("fold_gated_norms_drafted", SpecConfig(mode="chain", depth=5, bucket=8), 4,
                                    monkeypatch, caplog)
    assert log.count(f"{LAYERS} gated norms folded") == 1 and log.count("0 gated norms folded") == 1


def test_every_mlp_product_folds_into_its_down_projection_and_the_outputs_stay():
    """In a one-token twin, each layer's ``silu(gate) * up`` of its fused gate/up GEMM, read by down alone, becomes
    with down one ``specla.swiglu_linear`` of the gate/up output, in fp32 on the CPU (its PyTorch reference); not
    where something else reads the product. (The backend folds one-token twins alone.)"""
    gm, example_inputs = _static_twin_graph(seed=9, tokens=1)
    linears, silus = sum(folding.linear_parts(n) is not None for n in gm.graph.nodes), _calls(gm, *folding.SILUS)
    with torch.no_grad():
        expected = gm(*example_inputs)
        assert folding.fold_swiglu(gm) == 0  # (float32: no kernel to fold into by default)
        assert folding.fold_swiglu(gm, dtypes=(torch.float32,)) == LAYERS
        got = gm(*example_inputs)
    assert _calls(gm, SPECLA.swiglu_linear.default) == LAYERS and _calls(gm, *folding.SILUS) == silus - LAYERS
    assert sum(folding.linear_parts(n) is not None for n in gm.graph.nodes) == linears - LAYERS
    assert all(n.meta.get("example_value") is not None for n in gm.graph.nodes if n.op == "call_function")
    for g, e in zip(got, expected):
        assert (g - e).abs().max() <= 1e-5 * e.abs().max()
    gm, _ = _static_twin_graph(seed=9, tokens=1)
    first = next(n for n in gm.graph.nodes if _calls_node(n, *folding.MULS) and any(
        _calls_node(a, *folding.SILUS) for a in n.args if isinstance(a, torch.fx.Node)))
    with gm.graph.inserting_after(first):
        gm.graph.call_function(torch.neg, (first,))  # (a second reader of one layer's product)
    assert folding.fold_swiglu(gm, dtypes=(torch.float32,)) == LAYERS - 1


def test_a_drafted_twins_mlp_products_fold_for_the_few_row_kernel():
    """In a twin of 5 tokens (a drafted pass), each layer's MLP product folds with ``rows=5`` (the split few-row
    kernel's) and the outputs stay; not past the rows where that kernel pays (``SWIGLU_FOLD_ROWS``)."""
    gm, example_inputs = _static_twin_graph(seed=9, tokens=5)
    with torch.no_grad():
        expected = gm(*example_inputs)
        assert folding.fold_swiglu(gm, dtypes=(torch.float32,), rows=folding.SWIGLU_FOLD_ROWS + 1) == 0
        assert folding.fold_swiglu(gm, dtypes=(torch.float32,), rows=5) == LAYERS
        got = gm(*example_inputs)
    assert _calls(gm, SPECLA.swiglu_linear.default) == LAYERS
    for g, e in zip(got, expected):
        assert (g - e).abs().max() <= 1e-5 * e.abs().max()


@pytest.mark.parametrize("drafted", [True, False], ids=["drafted fold", "one-token fold alone"])
def test_decoding_through_folded_mlps_equals_eager_decoding(drafted, monkeypatch, caplog):
    """With ``fold_swiglu`` (made to fold here: CPU, fp32), the one-token twin of plain decoding folds each MLP's
    product into its down projection, and with ``fold_swiglu_drafted`` (both on by default) the draft bucket's twin
    too; drafted and plain decoding both equal eager decoding."""
    log = _decode_on_cpu_as_on_cuda("fold_swiglu", SpecConfig(mode="chain", depth=5, bucket=8), 8, monkeypatch, caplog,
                                    fold_swiglu_drafted=drafted)
    assert log.count(f"{LAYERS} MLPs' silu(gate) * up folded") == (2 if drafted else 1)


@pytest.mark.parametrize("option", ["fold_norms", "fold_gated_norms", "fold_gates", "fold_swiglu", "fold_swiglu_drafted"])
def test_the_fold_options_are_bools(option):
    from specla_compile.backend import specla_backend

    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=f"'{option}' must be True or False"):
        specla_backend(gm, [torch.randn(1, 2)], options={"inner": "eager", option: "yes"})


def _dynamo_graph(fn, *inputs) -> tuple[torch.fx.GraphModule, list]:
    """Dynamo's graph of ``fn(*inputs)`` and its inputs, in the graph's order."""
    graphs = []

    def keep(gm, example_inputs):
        graphs.append((gm, example_inputs))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=keep, dynamic=False)(*[x.clone() for x in inputs])
    return graphs[0]


def _norm(h, residual, w):
    return SPECLA.rms_norm(h, residual, w, 1e-6)


def _prenorm(a, b, w, W):  # fla's fused prenorm, the block's sum after it
    return torch.nn.functional.linear(_norm(a, b, w), W), (a + b) * 2


def _after_an_add(a, b, w, W):
    h = a + b
    return torch.nn.functional.linear(_norm(h, None, w), W), h * 2


def _gated(a, b, w, W):
    out = torch.nn.functional.linear(_norm(a + b, None, w), W)
    return torch.nn.functional.silu(torch.narrow(out, -1, 0, 8)) * torch.narrow(out, -1, 8, 8)


def _gate_of_the_wrong_half(a, b, w, W):
    out = torch.nn.functional.linear(_norm(a + b, None, w), W)
    return torch.nn.functional.silu(torch.narrow(out, -1, 8, 8)) * torch.narrow(out, -1, 0, 8)


def _broadcast_add(a, b, w, W):
    return torch.nn.functional.linear(_norm(a + b[:1], None, w), W)


def _sum_read_before_the_gemm(a, b, w, W):
    h = a + b
    y = _norm(h, None, w)
    kept = h * 3
    return torch.nn.functional.linear(y, W), kept


def _written_in_place_before_the_gemm(a, b, w, W):
    c = a.clone()
    y = _norm(c + b, None, w)
    c.mul_(2)
    return torch.nn.functional.linear(y, W), c


def _eps_by_keyword(a, b, w, W):
    return torch.nn.functional.linear(SPECLA.rms_norm(a + b, None, w, eps=1e-6), W)


def _two_gemms(a, b, w, W):
    y = _norm(a + b, None, w)
    return torch.nn.functional.linear(y, W), torch.nn.functional.linear(y, W[:4])


def _computed_weight(a, b, w, W):
    return torch.nn.functional.linear(_norm(a + b, None, w), W * 2)


FOLD_CASES = {  # function: (norms folded, the op it becomes)
    _prenorm: (1, SPECLA.add_norm_linear.default),
    _after_an_add: (1, SPECLA.add_norm_linear.default),
    _gated: (1, SPECLA.add_norm_gated_linear.default),
    _gate_of_the_wrong_half: (1, SPECLA.add_norm_linear.default),  # (the GEMM folds, the gate stays)
    _broadcast_add: (1, SPECLA.norm_linear.default),  # (the add stays: the op's sum has the rows' shape)
    _sum_read_before_the_gemm: (1, SPECLA.norm_linear.default),
    _written_in_place_before_the_gemm: (0, None),
    _eps_by_keyword: (0, None),
    _two_gemms: (0, None),
    _computed_weight: (1, SPECLA.add_norm_linear.default),
}


@pytest.mark.parametrize("fn", FOLD_CASES, ids=lambda fn: fn.__name__.strip("_"))
def test_what_folds_and_what_stays(fn):
    """Each pattern around a norm, as Dynamo captures it: what the pass folds into which op, and the same outputs
    (fp32, CPU references) where it folds or not."""
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(2, 3, 32, generator=gen), torch.randn(2, 3, 32, generator=gen)
    w, W = 1 + 0.2 * torch.randn(32, generator=gen), torch.randn(16, 32, generator=gen)
    gm, example_inputs = _dynamo_graph(fn, a, b, w, W)
    expected = fn(a, b, w, W)
    count, op = FOLD_CASES[fn]
    assert folding.fold_norms(gm, dtypes=(torch.float32,)) == count
    if op is not None:
        assert _calls(gm, op) == 1
        assert _calls(gm, *folding.ADDS) == (fn in (_broadcast_add, _sum_read_before_the_gemm))
    got = gm(*[x.clone() for x in example_inputs])
    for g, e in zip(got if isinstance(got, (tuple, list)) else [got], expected if isinstance(expected, tuple) else [expected]):
        assert (g - e).abs().max() <= 1e-5 * e.abs().max()


ROW_FOLD_CASES = {  # function: whether the one add_norm_row_gemv it becomes reads its sum rounded (an add, then a norm,
    # as compiled; False: fla's fused prenorm, unrounded), or None where nothing folds
    _prenorm: False, _after_an_add: True, _gated: True, _gate_of_the_wrong_half: True,
    _broadcast_add: None, _sum_read_before_the_gemm: None,  # (no add folds: the CUDA GEMV leaves no norm alone)
    _written_in_place_before_the_gemm: None, _eps_by_keyword: None, _two_gemms: None,
    _computed_weight: None,  # (the GEMV loads a graph input's weights before the kernel before it ends)
}


@pytest.mark.parametrize("fn", ROW_FOLD_CASES, ids=lambda fn: fn.__name__.strip("_"))
def test_what_folds_into_the_cuda_gemv_and_what_stays(fn, monkeypatch):
    """``fold_row_norms`` (made to fold here: CPU, fp32) on each pattern around a norm: a norm after a residual add
    folds with its add, reading the sum as the compiled graph would (fla's fused prenorm: unrounded; an add, then a
    norm: rounded); the same outputs."""
    monkeypatch.setattr(folding, "FOLDED_DTYPES", (torch.float32,))
    monkeypatch.setattr(folding.cuda_gemv, "weight_fits", lambda *args: True)
    gen = torch.Generator().manual_seed(2)
    a, b = torch.randn(2, 3, 32, generator=gen), torch.randn(2, 3, 32, generator=gen)
    w, W = 1 + 0.2 * torch.randn(32, generator=gen), torch.randn(16, 32, generator=gen)
    expected = fn(a, b, w, W)
    round_sum = ROW_FOLD_CASES[fn]
    gm, example_inputs = _dynamo_graph(fn, a, b, w, W)
    adds = _calls(gm, *folding.ADDS)
    assert folding.fold_row_norms(gm) == (round_sum is not None)
    assert [n.args[5] for n in gm.graph.nodes if _calls_node(n, SPECLA.add_norm_row_gemv.default)] == (
        [] if round_sum is None else [round_sum])
    assert _calls(gm, *folding.ADDS) == (adds if round_sum is None else 0)  # (the op's sum stands for the add)
    got = gm(*[x.clone() for x in example_inputs])
    for g, e in zip(got if isinstance(got, (tuple, list)) else [got], expected if isinstance(expected, tuple) else [expected]):
        assert (g - e).abs().max() <= 1e-5 * e.abs().max()


def test_a_norm_whose_weights_the_cuda_gemv_does_not_take_stays(monkeypatch):
    """``fold_row_norms`` asks ``cuda_gemv.weight_fits`` (unpatched here; the fold's dtype test made to pass float32):
    float32 weights, which the kernel does not take, leave the norm and its add as they are."""
    monkeypatch.setattr(folding, "FOLDED_DTYPES", (torch.float32,))
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randn(1, 1, 256, generator=gen), torch.randn(1, 1, 256, generator=gen)
    w, W = 1 + 0.2 * torch.randn(256, generator=gen), torch.randn(16, 256, generator=gen)
    gm, _ = _dynamo_graph(_after_an_add, a, b, w, W)
    assert folding.fold_row_norms(gm) == 0 and _calls(gm, *folding.NORMS) == 1 and _calls(gm, *folding.ADDS) == 1
    monkeypatch.setattr(folding.cuda_gemv, "weight_fits", lambda *args: True)  # (what the kernel would take: folds)
    assert folding.fold_row_norms(gm) == 1

