"""Route a static twin's GEMMs to specla's linear kernels: each RMS norm folded into the GEMM that reads it, with
the residual add before it (:func:`fold_norms`), or the GEMMs alone (:func:`route_linears`).

At B=1 a GDN layer's pass runs 13 kernels on the H200, and the small ones between its GEMMs cost as much as
a GEMM: the residual add and norm before the q/k/v/gate projection, the add and norm before the MLP, the
MLP's ``silu(gate) * up``, each a launch of 1-2.5 us plus its gap. The ``specla::`` linear ops do that work
inside the GEMM for up to 32 rows (``kernels/triton_linear.py``). :func:`fold_norms` rewrites, in a per-size
twin's graph (static shapes: the rows are known), each

    y = specla.rms_norm(a, b, w, eps); out = linear(y, W)     (fla's fused prenorm; the block's a + b after it)
    h = a + b;  y = specla.rms_norm(h, None, w, eps);  out = linear(y, W)
                                                             [-> silu(out[..., :N]) * out[..., N:]]

into one ``specla.add_norm_linear(a, b, w, eps, W)`` (or its gated twin, or ``norm_linear`` when no add comes
with the norm) whose second output, the rounded sum, replaces ``a + b`` in the rest of the graph. The folded
op normalizes the rounded sum, where fla's fused prenorm normalizes the float32 one: results move by bf16
rounding (plain and speculative passes fold alike). Norms read by anything but one bias-free GEMM, and norms
with an in-place op between their inputs and the GEMM, stay as they are (composite ops, which inductor fuses).

:func:`route_linears` rewrites each bias-free ``linear(x, W)`` (and the MLP's ``silu(gate) * up`` after it) into
``specla.linear`` (``specla.gated_linear``), one Triton launch each that, on Hopper, launches with PDL
(``kernels/pdl.py``): cuBLAS's kernels do not, so every GEMM kept the launch gap before it. Measured on an H200
at the GDN-1.3B shape, the passes were no faster for it (``docs/speed.md``): the backend's ``triton_linears``.

The one-row twin (plain decoding's step at B=1) folds more into one-row GEMVs (``kernels/triton_gemv.py``):
:func:`fold_gated_norms` a GDN layer's gated output norm into its o_proj, :func:`fold_swiglu` the MLP's
``silu(gate) * up`` into its down projection; given a twin's ``rows``, both fold into few-row kernels instead
(``kernels/triton_linear.py``: the backend's ``fold_gated_norms_drafted`` and ``fold_swiglu_drafted``). With the backend's ``cuda_gemvs``, :func:`fold_row_norms` folds each
residual add and RMS norm into the CUDA C GEMV after it (``kernels/cuda_gemv.cu``; unlike :func:`fold_norms`, the
norm reads the sum as the compiled graph would), and :func:`route_row_gemvs` routes the GEMMs left, with the other
folds' work as their prologue, there.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence

import torch
import torch.fx as fx

from ..kernels import cuda_gemv, ops
from .fuse_projections import linear_parts
from .graph_analysis import example_value, fill_example_values, graph_fake_mode, is_call, recompiled, written_tensors

NORMS = (torch.ops.specla.rms_norm.default, torch.ops.specla.rms_norm)
GATED_NORMS = (torch.ops.specla.rms_norm_gated.default, torch.ops.specla.rms_norm_gated)
ADDS = (operator.add, torch.add)
MULS = (operator.mul, torch.mul)
SILUS = (torch.nn.functional.silu, torch.ops.aten.silu.default)
FOLDED_DTYPES = (torch.bfloat16,)  # where the ops have a kernel (kernels/cuda.py); other dtypes keep the norm
GEMV_BLOCK_K = ops.GATED_NORM_GEMV_BLOCK_K  # what a gated norm's heads must fill to fold (ops.gated_norm_gemv_heads_fit)
# rows up to which an MLP's product folds into the split few-row kernel: at 32 rows it was slower than inductor's
# product and cuBLAS's split-K (19.9 against 15.1 us a layer on an H100, fold_gpu.py --sections swiglu_down)
SWIGLU_FOLD_ROWS = 16


def _only_user(node: fx.Node) -> fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _added(node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """``(a, b)`` of ``node = a + b``, two tensors of one shape and dtype, else None."""
    if not is_call(node, ADDS) or len(node.args) != 2 or node.kwargs:
        return None
    values = [example_value(a) for a in node.args]
    if None in values or values[0].shape != values[1].shape or values[0].dtype != values[1].dtype:
        return None
    return node.args[0], node.args[1]


def _slice(node: fx.Node, source: fx.Node) -> tuple[int, int] | None:
    """``(start, length)`` of ``node = narrow(source, -1, start, length)``, else None."""
    if not (is_call(node, (torch.narrow,)) and node.args[0] is source and len(node.args) == 4):
        return None
    dim = node.args[1]
    rank = example_value(source).dim() if example_value(source) is not None else None
    return (node.args[2], node.args[3]) if dim == -1 or dim == (rank - 1 if rank else None) else None


def _silu_times_up(linear: fx.Node) -> fx.Node | None:
    """The node ``silu(out[..., :N]) * out[..., N:]`` when that is all that reads the GEMM's output ``out``
    of ``2N`` columns (the MLP's fused gate/up projection), else None."""
    out = example_value(linear)
    if out is None or len(linear.users) != 2:
        return None
    halves = {}
    for part in linear.users:
        span = _slice(part, linear)
        if span is None:
            return None
        halves[span] = part
    columns = out.shape[-1]
    gate, up = halves.get((0, columns // 2)), halves.get((columns // 2, columns // 2))
    if gate is None or up is None or columns % 2:
        return None
    silu = _only_user(gate)
    mul = _only_user(silu) if silu is not None and is_call(silu, SILUS) and len(silu.args) == 1 else None
    if mul is None or not is_call(mul, MULS) or set(mul.args) != {silu, up} or _only_user(up) is not mul:
        return None
    return mul


def _whole(node: fx.Node) -> bool:
    """Whether ``node`` indexes all of its input (``y[:, 0:]``: the LM head's ``logits_to_keep=0``)."""
    if not (is_call(node, (operator.getitem,)) and isinstance(node.args[1], tuple)):
        return False
    return all(isinstance(s, slice) and s.start in (None, 0) and s.stop is None and s.step in (None, 1)
               for s in node.args[1])


def _reader(norm: fx.Node) -> fx.Node | None:
    """The one node that reads the norm's output, looking through an indexing that keeps all of it."""
    user = _only_user(norm)
    return _only_user(user) if user is not None and _whole(user) else user


def _order(graph: fx.Graph) -> dict[fx.Node, int]:
    return {node: i for i, node in enumerate(graph.nodes)}


def _writes_between(graph: fx.Graph, first: fx.Node, last: fx.Node) -> bool:
    """Whether a node strictly between ``first`` and ``last`` may write a tensor in place."""
    order = _order(graph)
    return any(written_tensors(n) for n in graph.nodes if order[first] < order[n] < order[last])


def _dtype(node) -> torch.dtype | None:
    """The dtype of a tensor node (of an ``as_strided`` weight: its base's)."""
    if isinstance(node, fx.Node) and is_call(node, (torch.as_strided,)):
        node = node.args[0]
    value = example_value(node)
    return value.dtype if value is not None else None


def _norm_calls(graph: fx.Graph, targets: tuple) -> list[fx.Node]:
    """The graph's calls of ``targets`` in the norms' form (four positional arguments), in order."""
    return [n for n in graph.nodes if is_call(n, targets) and not n.kwargs and len(n.args) == 4]


def _product_nodes(product: fx.Node) -> list[fx.Node]:
    """The nodes of ``silu(gate) * up`` as :func:`_silu_times_up` found it: the product, the SiLU, the two slices."""
    silu, up = product.args if is_call(product.args[0], SILUS) else product.args[::-1]
    return [product, silu, silu.args[0], up]


def _graph_weight(weight: fx.Node) -> bool:
    """Whether ``weight`` is a graph input (a parameter): the one-row GEMVs load its first tile before the kernel
    before them ends, which no kernel of the pass may write."""
    return weight.op in ("placeholder", "get_attr")


def _replace(linear: fx.Node, gated: fx.Node | None, out: fx.Node) -> list[fx.Node]:
    """Make ``out`` stand for the GEMM (or for the ``silu(gate) * up`` after it, when ``gated``); returns the nodes
    left dead, the GEMM's own last."""
    (gated if gated is not None else linear).replace_all_uses_with(out)
    dead = _product_nodes(gated) if gated is not None else []
    dead.append(linear)
    return dead


def route_linears(gm: fx.GraphModule, dtypes: Sequence[torch.dtype] | None = None) -> int:
    """Rewrite, in place, every bias-free ``linear`` of a ``dtypes`` input and weight into ``specla.linear``, or
    with the ``silu(gate) * up`` after it into ``specla.gated_linear`` (default ``FOLDED_DTYPES``). Returns the
    number of GEMMs routed."""
    dtypes = FOLDED_DTYPES if dtypes is None else dtypes
    graph = gm.graph
    fake_mode = graph_fake_mode(graph)
    routed = 0
    for linear in [n for n in graph.nodes if linear_parts(n) is not None]:
        rows, weight = linear_parts(linear)
        if _dtype(rows) not in dtypes or _dtype(weight) != _dtype(rows):
            continue
        gated = _silu_times_up(linear)
        with graph.inserting_before(linear):
            op = ops.gated_linear if gated is not None else ops.linear
            out = graph.call_function(op._opoverload, (rows, weight))
        for node in _replace(linear, gated, out):
            graph.erase_node(node)
        fill_example_values(graph, fake_mode)  # (the next GEMM may read this one's output: down reads gate/up's)
        routed += 1
    return recompiled(gm, routed)


def _norm_site(graph: fx.Graph, norm: fx.Node, dtypes: Sequence[torch.dtype]) -> tuple | None:
    """Where ``norm`` (``specla.rms_norm``) folds into the bias-free ``linear`` that alone reads it: ``(linear, weight,
    added, sums)``, ``added`` the ``(a, b)`` of the add that folds with it (fla's fused prenorm's pair, or an ``a + b``
    read after the GEMM only) or None, ``sums`` the nodes holding ``a + b`` that the folded op's sum replaces (all
    read after the GEMM). None where it does not fold: another reader, a dtype outside ``dtypes`` or mixed, or a
    tensor written in place between the norm's inputs and the GEMM (the folded op, placed at the GEMM, reads them
    later than the graph did)."""
    rows, residual, norm_weight, _ = norm.args
    linear = _reader(norm)
    parts = linear_parts(linear) if linear is not None else None
    inputs = [rows, norm_weight, parts[1]] + ([residual] if residual is not None else []) if parts else []
    if parts is None or parts[0] not in (norm, *norm.users) or _dtype(rows) not in dtypes or any(
            _dtype(t) != _dtype(rows) for t in inputs):
        return None  # (one dtype for all: the ops' kernels take nothing else)
    order = _order(graph)
    if residual is not None:
        sums = [u for u in rows.users if _added(u) and set(u.args) == {rows, residual}]
        added, start = (rows, residual), norm
    else:
        added, sums, start = _added(rows), [rows], rows
        if added is None or any(order[u] < order[linear] for u in rows.users if u is not norm):
            added, sums, start = None, [], norm  # (the sum is read before the GEMM, where the op would write it)
    sums = [s for s in sums if all(order[u] > order[linear] for u in s.users if u is not norm)]
    return None if _writes_between(graph, start, linear) else (linear, parts[1], added, sums)


def _fold_norm(graph: fx.Graph, norm: fx.Node, linear: fx.Node, out: fx.Node, sums: list[fx.Node],
               total: fx.Node | None, gated: fx.Node | None = None) -> None:
    """Make ``out`` stand for the GEMM (or the ``silu(gate) * up`` after it, when ``gated``) and ``total``, the folded
    op's sum, for ``sums``; erase what is left dead."""
    for summed in sums if total is not None else ():
        summed.replace_all_uses_with(total)
    dead = _replace(linear, gated, out)
    dead += [user for user in norm.users if user is not linear] + [norm]  # (the indexing looked through)
    dead += [summed for summed in sums if total is not None and not summed.users]
    for node in dead:
        graph.erase_node(node)


def fold_norms(gm: fx.GraphModule, dtypes: Sequence[torch.dtype] | None = None) -> int:
    """Fold, in place, every ``specla.rms_norm`` of a ``dtypes`` input whose only reader is a bias-free
    ``linear`` into a ``specla::`` linear op with the norm (and the add that made its input, and a following
    ``silu(gate) * up``; default ``FOLDED_DTYPES``). Returns the number of norms folded."""
    dtypes = FOLDED_DTYPES if dtypes is None else dtypes
    graph = gm.graph
    fake_mode = graph_fake_mode(graph)
    folded = 0
    for norm in _norm_calls(graph, NORMS):
        site = _norm_site(graph, norm, dtypes)
        if site is None:
            continue
        linear, weight, added, sums = site
        rows, _, norm_weight, eps = norm.args
        gated = _silu_times_up(linear)
        total = None
        with graph.inserting_before(linear):
            if added is None:
                op = ops.norm_gated_linear if gated is not None else ops.norm_linear
                out = graph.call_function(op._opoverload, (rows, norm_weight, eps, weight))
            else:
                op = ops.add_norm_gated_linear if gated is not None else ops.add_norm_linear
                pair = graph.call_function(op._opoverload, (*added, norm_weight, eps, weight))
                out = graph.call_function(operator.getitem, (pair, 0))
                total = graph.call_function(operator.getitem, (pair, 1))
        _fold_norm(graph, norm, linear, out, sums, total, gated)
        fill_example_values(graph, fake_mode)  # (the next norm may read this one's sum as its add's input)
        folded += 1
    return recompiled(gm, folded)


def _heads_flattened(node: fx.Node, heads: fx.Node) -> bool:
    """Whether ``node`` reshapes ``heads`` ([..., H, D]) to [..., H * D] and nothing else."""
    if not (node.op == "call_method" and node.target in ("reshape", "view") and node.args[0] is heads):
        return False
    shape, flat = example_value(heads), example_value(node)
    return shape is not None and flat is not None and tuple(flat.shape) == (*shape.shape[:-2], shape.shape[-2] * shape.shape[-1])


def fold_gated_norms(gm: fx.GraphModule, dtypes: Sequence[torch.dtype] | None = None, rows: int = 1) -> int:
    """Fold, in place, every ``specla.rms_norm_gated`` of a ``dtypes`` input (a GDN layer's output norm) whose only
    reader is the reshape of its heads into one row and then a bias-free ``linear`` (o_proj) of a weight the graph
    takes as an input into ``specla.gated_norm_linear`` (default ``FOLDED_DTYPES``), where its CUDA kernel for the
    graph's ``rows`` (batch rows times nodes: the example values' sizes may be symbolic) takes the heads: for one
    row, the one-row GEMV (``ops.gated_norm_gemv_heads_fit``: the plain step at B=1); for up to 32, the few-row
    kernel (``ops.gated_norm_rows_heads_fit``: a drafted pass's, where the backend's ``fold_gated_norms_drafted``
    asks for it).
    Returns the number of norms folded."""
    dtypes = FOLDED_DTYPES if dtypes is None else dtypes
    if rows == 1:
        kernel_takes = functools.partial(ops.gated_norm_gemv_heads_fit, block_k=GEMV_BLOCK_K)
    elif rows <= ops.LINEAR_MAX_ROWS:
        kernel_takes = ops.gated_norm_rows_heads_fit
    else:
        return 0
    graph = gm.graph
    fake_mode = graph_fake_mode(graph)
    folded = 0
    for norm in _norm_calls(graph, GATED_NORMS):
        x, gate, norm_weight, eps = norm.args
        flat = _only_user(norm)
        linear = _only_user(flat) if flat is not None and _heads_flattened(flat, norm) else None
        parts = linear_parts(linear) if linear is not None else None
        if parts is None or parts[0] is not flat or _dtype(x) not in dtypes or any(
                _dtype(t) != _dtype(x) for t in (gate, parts[1])):
            continue
        heads, gates, norm_weights, weight = (example_value(n) for n in (x, gate, norm_weight, parts[1]))
        if any(v is None for v in (heads, gates, norm_weights, weight)) or gates.shape != heads.shape or (
                norm_weights.numel() != heads.shape[-1]) or not kernel_takes(*heads.shape[-2:], weight):
            continue  # (where no kernel takes it, the op's reference would be slower than the unfolded norm)
        if not _graph_weight(parts[1]) or _writes_between(graph, norm, linear):
            continue  # (the op reads the heads later than the norm did)
        with graph.inserting_before(linear):
            out = graph.call_function(ops.gated_norm_linear._opoverload, (x, gate, norm_weight, eps, parts[1]))
        linear.replace_all_uses_with(out)
        for node in (linear, flat, norm):
            graph.erase_node(node)
        fill_example_values(graph, fake_mode)
        folded += 1
    return recompiled(gm, folded)


def fold_swiglu(gm: fx.GraphModule, dtypes: Sequence[torch.dtype] | None = None, rows: int = 1) -> int:
    """Fold, in place, every MLP's ``silu(gate) * up`` of ``dtypes`` rows (the halves of its packed gate/up GEMM,
    read by nothing else) with the bias-free ``linear`` (down) of a graph-input weight that alone reads it into
    ``specla.swiglu_linear(gate_up, W)`` (default ``FOLDED_DTYPES``), where its CUDA kernel for the graph's ``rows``
    (batch rows times nodes) takes the sizes: for one row, the one-row GEMV (``ops.swiglu_gemv_block_k``: the plain
    step at B=1); for up to ``SWIGLU_FOLD_ROWS``, the split few-row kernel (a drafted pass's, where the backend's
    ``fold_swiglu_drafted`` asks for it).
    Returns the number of MLPs folded."""
    dtypes = FOLDED_DTYPES if dtypes is None else dtypes
    if rows > SWIGLU_FOLD_ROWS:
        return 0
    graph = gm.graph
    fake_mode = graph_fake_mode(graph)
    folded = 0
    for gate_up in [n for n in graph.nodes if linear_parts(n) is not None]:
        product = _silu_times_up(gate_up)
        down = _only_user(product) if product is not None else None
        parts = linear_parts(down) if down is not None else None
        if parts is None or parts[0] is not product or _dtype(gate_up) not in dtypes or _dtype(parts[1]) != _dtype(gate_up):
            continue
        weight = example_value(parts[1])
        if weight is None or weight.dim() != 2 or (rows == 1 and ops.swiglu_gemv_block_k(weight) is None):
            continue
        if not _graph_weight(parts[1]) or _writes_between(graph, gate_up, down):
            continue  # (the op reads gate/up later than the product did)
        with graph.inserting_before(down):
            out = graph.call_function(ops.swiglu_linear._opoverload, (gate_up, parts[1]))
        down.replace_all_uses_with(out)
        for node in (down, *_product_nodes(product)):
            graph.erase_node(node)
        fill_example_values(graph, fake_mode)
        folded += 1
    return recompiled(gm, folded)


def _weight_input(weight: fx.Node) -> bool:
    """A graph input, or :func:`~.fuse_projections.fuse_projections`' packed view of one."""
    packed = is_call(weight, (torch.as_strided,)) and isinstance(weight.args[0], fx.Node)
    return _graph_weight(weight.args[0] if packed else weight)


def fold_row_norms(gm: fx.GraphModule) -> int:
    """Fold, in place, every ``specla.rms_norm`` of one bf16 row whose input is a residual add (fla's fused prenorm's
    pair, or an ``a + b`` read after the GEMM only) and whose only reader is a bias-free ``linear`` of a graph-input
    weight the CUDA C GEMV takes into ``specla.add_norm_row_gemv``, whose sum replaces the add's: the backend's
    ``cuda_gemvs`` option, in the one-token twin of a batch of one (before :func:`route_row_gemvs`). The norm reads the
    sum as the compiled graph would: fla's fused prenorm unrounded; after an add, rounded to bf16, as eager PyTorch
    and inductor both do (on CUDA too: ``test_gpu_kernels``' add-then-norm test, measured on an H100). A norm without
    an add (the first layer's, of the embedding) stays. Returns the number of norms folded."""
    graph = gm.graph
    fake_mode = graph_fake_mode(graph)
    fill_example_values(graph, fake_mode)  # (the packed weights' views have none yet)
    folded = 0
    for norm in _norm_calls(graph, NORMS):
        site = _norm_site(graph, norm, FOLDED_DTYPES)
        if site is None or site[2] is None:
            continue
        linear, weight, added, sums = site
        rows, residual, norm_weight, eps = norm.args
        x, w = example_value(rows), example_value(weight)
        if not _weight_input(weight) or x is None or w is None or not cuda_gemv.weight_fits(
                w, x.dtype, x.shape[-1], "add_norm", x.shape[-1], example_value(norm_weight)):
            continue
        with graph.inserting_before(linear):
            rounded = residual is None  # (an add, then a norm; fla's fused prenorm reads the fp32 sum)
            pair = graph.call_function(ops.add_norm_row_gemv._opoverload, (*added, norm_weight, eps, weight, rounded))
            out = graph.call_function(operator.getitem, (pair, 0))
            total = graph.call_function(operator.getitem, (pair, 1))
        for node in (pair, out, total):  # (the norm's module: a layer's input norm starts its region, lowering/regions.py)
            node.meta["nn_module_stack"] = dict(norm.meta.get("nn_module_stack") or {})
        _fold_norm(graph, norm, linear, out, sums, total)
        fill_example_values(graph, fake_mode)
        folded += 1
    return recompiled(gm, folded)


def _row_gemv_call(node: fx.Node) -> tuple[tuple, int, int | None, torch.Tensor | None] | None:
    """``specla.row_gemv``'s arguments for a GEMM the CUDA C GEMV could run (a bias-free ``linear``,
    :func:`fold_swiglu`'s ``swiglu_linear`` or :func:`fold_gated_norms`' ``gated_norm_linear``), with the width of
    its row and, for the gated norm, the size of its heads and its norm weight's example value; None for any other
    node."""
    if is_call(node, (ops.swiglu_linear._opoverload,)):
        gate_up, weight = node.args
        x = example_value(gate_up)
        return None if x is None else ((gate_up, weight, "swiglu"), x.shape[-1], None, None)
    if is_call(node, (ops.gated_norm_linear._opoverload,)):
        rows, gate, norm_weight, eps, weight = node.args
        x = example_value(rows)
        heads = None if x is None else (x.shape[-2] * x.shape[-1], x.shape[-1], example_value(norm_weight))
        return None if heads is None else ((rows, weight, "gated_norm", gate, norm_weight, eps), *heads)
    parts = linear_parts(node)
    x = example_value(parts[0]) if parts is not None else None
    return None if x is None else ((*parts, "none"), x.shape[-1], None, None)


def route_row_gemvs(gm: fx.GraphModule) -> int:
    """Rewrite, in place, every bias-free ``linear`` of one bf16 row, and every ``specla.swiglu_linear``
    (:func:`fold_swiglu`'s) and ``specla.gated_norm_linear`` (:func:`fold_gated_norms`'), whose weight (a graph
    input) the CUDA C GEMV takes (``kernels/cuda_gemv.weight_fits``, on example values) into ``specla.row_gemv``
    with the fold's work as its prologue: the backend's ``cuda_gemvs`` option, in the one-token twin of a batch of
    one (the op's CUDA kernel takes one row, and runs its reference for more). Returns the number of GEMMs routed."""
    graph = gm.graph
    fill_example_values(graph, graph_fake_mode(graph))  # (the packed weights' views have none yet)
    routed = 0
    for node in list(graph.nodes):
        call = _row_gemv_call(node)
        if call is None or not _weight_input(call[0][1]):
            continue
        args, width, dim, norm_weight = call
        rows, weight = example_value(args[0]), example_value(args[1])
        if weight is None or not cuda_gemv.weight_fits(weight, rows.dtype, width, args[2], dim, norm_weight):
            continue
        with graph.inserting_before(node):
            out = graph.call_function(ops.row_gemv._opoverload, args)
        out.meta = dict(node.meta)
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        routed += 1
    return recompiled(gm, routed)
