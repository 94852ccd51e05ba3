"""Fold a GDN layer's gates (the backend's ``fold_gates``), and then its q/k/v convs (``fold_convs``), into plain
decoding's recurrence launch.

Between a layer's convs and its recurrence, fla's GatedDeltaNet computes its gates as

    g = -A_log.float().exp() * softplus(a.float() + dt_bias.float());   beta = b.float().sigmoid()

(``a``, ``b``: slices of the fused q/k/v/gate projection's output), which inductor runs as a small kernel of its
own: at B=1 on an H200 3.7-4.0 us a layer, launch gap included (``docs/speed.md``). :func:`fold_gates` rewrites,
in a twin whose passes have one node a row (plain decoding's step), each ``specla.gdn_commit_verify_`` whose ``g``
and ``beta`` are those expressions into ``specla.gdn_gates_commit_verify_``: the recurrence's launch computes them
and returns them as the pass's records. Gates of any other form (transformers' Qwen3.5 takes ``sigmoid`` of the
bf16 projection) stay as they are.

The layer's three short convs (q, k, v, one launch of 4.2-4.7 us a layer at the same shape) come before it.
:func:`fold_convs` rewrites a folded recurrence whose q, k and v are the heads of those convs' outputs into
``specla.gdn_conv_gates_commit_verify_``, whose one-node kernel convolves the projection's slices itself
(``triton_verify._one_token_conv_gates_kernel``).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .graph_analysis import (
    VIEW_METHODS,
    example_value,
    fill_example_values,
    getitem_users,
    graph_fake_mode,
    is_call,
    recompiled,
    written_tensors,
)

VERIFY = (torch.ops.specla.gdn_commit_verify_.default, torch.ops.specla.gdn_commit_verify_)
FOLDED = torch.ops.specla.gdn_gates_commit_verify_.default
CONVS = (torch.ops.specla.commit_three_tree_convs_.default, torch.ops.specla.commit_three_tree_convs_)
CONVS_FOLDED = torch.ops.specla.gdn_conv_gates_commit_verify_.default
RESHAPES = ("reshape", "view", "unflatten")
MULS, ADDS = (operator.mul, torch.mul), (operator.add, torch.add)
NEGS, EXPS = (operator.neg, torch.neg), (torch.exp,)
SOFTPLUS = (torch.nn.functional.softplus, torch._C._nn.softplus)
SIGMOIDS = (torch.sigmoid, torch.nn.functional.sigmoid)
KERNEL_SOURCE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what the kernel reads as float32


def _args(node: fx.Node, functions: tuple, method: str | None, count: int) -> tuple | None:
    """The ``count`` positional arguments of ``node`` when it calls one of ``functions`` (or the tensor ``method``)
    with nothing else, else None."""
    if not isinstance(node, fx.Node):
        return None  # (a Python number: ``g = x * 0.5``)
    called = is_call(node, functions) or (method is not None and node.op == "call_method" and node.target == method)
    return tuple(node.args) if called and len(node.args) == count and not node.kwargs else None


def _float32_of(node) -> fx.Node | None:
    """The tensor that ``node`` is as float32: the input of ``x.float()`` / ``x.to(torch.float32)``, or ``node``
    itself when it is float32 already; None for anything else, or a source the kernel does not read."""
    value = example_value(node)
    if value is None or value.dtype != torch.float32:
        return None
    cast = node.op == "call_method" and not node.kwargs and (
        (node.target == "float" and len(node.args) == 1) or (node.target == "to" and tuple(node.args[1:]) == (torch.float32,)))
    source = node.args[0] if cast else node
    value = example_value(source)
    return source if value is not None and value.dtype in KERNEL_SOURCE_DTYPES else None


def _gate(g: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node] | None:
    """``(a, A_log, dt_bias)`` of ``g = -exp(A_log) * softplus(a + dt_bias)`` (each through its float32 cast)."""
    factors = _args(g, MULS, None, 2)
    for negated, soft in (factors, factors[::-1]) if factors else ():
        exp = _args(negated, NEGS, "neg", 1)
        a_log = _args(exp[0], EXPS, "exp", 1) if exp else None
        summed = _args(soft, SOFTPLUS, None, 1)
        terms = _args(summed[0], ADDS, None, 2) if summed else None
        if a_log is None or terms is None:
            continue
        x, y, a_log = _float32_of(terms[0]), _float32_of(terms[1]), _float32_of(a_log[0])
        if None in (x, y, a_log):
            continue
        a, dt_bias = (x, y) if example_value(y).dim() == 1 else (y, x)
        return a, a_log, dt_bias
    return None


def _root(node: fx.Node) -> fx.Node:
    """The tensor ``node`` is a view of (through slices, splits, indexing and view methods)."""
    while (is_call(node, (torch.narrow, torch.split, operator.getitem))
           or (node.op == "call_method" and node.target in (*VIEW_METHODS, "narrow", "split"))) and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def _unwritten_before(graph: fx.Graph, sources: list[fx.Node], node: fx.Node) -> bool:
    """Whether no node before ``node`` writes into a tensor that ``sources`` view (the fold reads them there)."""
    roots = {_root(s) for s in sources}
    for earlier in graph.nodes:
        if earlier is node:
            return True
        if any(_root(t) in roots for t in written_tensors(earlier)):
            return False
    return True


def _erase_dead(graph: fx.Graph, nodes: list[fx.Node]) -> None:
    """Erase ``nodes`` and then their inputs, each once nothing reads it (pure computations only)."""
    erased = set()
    while nodes:
        node = nodes.pop()
        if node in erased or node.users or node.op not in ("call_function", "call_method") or written_tensors(node):
            continue
        nodes.extend(node.all_input_nodes)
        graph.erase_node(node)
        erased.add(node)


def _heads_match(beta: fx.Node, *gate_inputs: fx.Node) -> bool:
    """Whether ``a, b`` are ``[B, N, HV]`` and ``A_log, dt_bias`` ``[HV]`` for ``beta [B, N, HV]`` (the value heads
    compared alone: a twin's node count may be symbolic)."""
    shape = example_value(beta).shape
    a, b, a_log, dt_bias = (example_value(t).shape for t in gate_inputs)
    return len(shape) == len(a) == len(b) == 3 and a[-1] == b[-1] == shape[-1] and tuple(a_log) == tuple(dt_bias) == (shape[-1],)


def fold_gates(gm: fx.GraphModule, nodes: int | None = None, drafted: bool = False) -> int:
    """Rewrite, in place, every one-node ``specla.gdn_commit_verify_`` (with ``drafted``, of any node count: the
    parallel route's kernel computes them too) whose gate and beta are fla's expressions of their projections into
    ``specla.gdn_gates_commit_verify_`` (see the module docstring); returns the number folded. ``nodes``: the
    graph's nodes a row, where its example values leave the count symbolic (the static engine's one graph for every
    bucket)."""
    graph = gm.graph
    fake_mode = graph_fake_mode(graph)
    order = {node: i for i, node in enumerate(graph.nodes)}
    folded = 0
    for verify in [n for n in graph.nodes if is_call(n, VERIFY)]:
        if len(verify.args) != 14 or verify.kwargs:
            continue
        state, *pending, num_pending, q, k, v, g, beta, parents, scale, use_qk_l2norm = verify.args
        count = nodes if nodes is not None else example_value(parents).shape[1]
        gate, sigmoid = _gate(g), _args(beta, SIGMOIDS, "sigmoid", 1)
        b = _float32_of(sigmoid[0]) if sigmoid else None
        if (count != 1 and not drafted) or gate is None or b is None or not _heads_match(beta, gate[0], b, *gate[1:]):
            continue
        a, a_log, dt_bias = gate
        if any(order[u] < order[verify] for t in (g, beta) for u in t.users) or not _unwritten_before(
                graph, [a, b, a_log, dt_bias], verify):
            continue  # (the gates are read before the recurrence, or their sources written before it reads them)
        with graph.inserting_before(verify):
            fused = graph.call_function(FOLDED, (state, *pending, num_pending, q, k, v, a, b, a_log, dt_bias, parents,
                                                 scale, use_qk_l2norm))
            outputs = [graph.call_function(operator.getitem, (fused, i)) for i in range(4)]
        for index, old in ((2, g), (3, beta)):
            old.replace_all_uses_with(outputs[index], delete_user_cb=lambda user, kept=verify: user is not kept)
        verify.replace_all_uses_with(fused)
        graph.erase_node(verify)
        _erase_dead(graph, [g, beta, *outputs])
        fill_example_values(graph, fake_mode)
        folded += 1
    return recompiled(gm, folded)


def _conv_head(node: fx.Node, convs: fx.Node, index: int, dims: tuple[int | None, int], alone: bool = True) -> bool:
    """Whether ``node`` reshapes ``convs``' output ``index``, which nothing else reads, into heads whose last two sizes
    are ``dims`` (None: any), and, if ``alone``, is itself read by one node."""
    source = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    reshaped = (node.op == "call_method" and node.target in RESHAPES) or is_call(node, (torch.reshape, torch.unflatten))
    if not (reshaped and source is not None and is_call(source, (operator.getitem,)) and source.args == (convs, index)
            and len(source.users) == 1 and (len(node.users) == 1 or not alone)):
        return False
    heads, flat = example_value(node), example_value(source)
    return (heads is not None and flat is not None and heads.dim() == 4 and heads.shape[-1] == dims[1]
            and dims[0] in (None, heads.shape[-2]) and heads.shape[-2] * heads.shape[-1] == flat.shape[-1])


def fold_convs(gm: fx.GraphModule) -> int:
    """Rewrite, in place, every ``specla.gdn_gates_commit_verify_`` (left by :func:`fold_gates`) whose q, k and v are
    the heads of one ``specla.commit_three_tree_convs_``'s outputs, read by nothing else, into
    ``specla.gdn_conv_gates_commit_verify_``: on GPUs the convs run in the recurrence's launch too (the backend's
    ``fold_convs``). Returns the number folded."""
    graph = gm.graph
    fake_mode = graph_fake_mode(graph)
    order = {node: i for i, node in enumerate(graph.nodes)}
    folded = 0
    for verify in [n for n in graph.nodes if n.target is FOLDED]:
        state, *pending, num_pending, q, k, v, a, b, a_log, dt_bias, parents, scale, use_qk_l2norm = verify.args
        convs = q.args[0].args[0] if q.args and isinstance(q.args[0], fx.Node) and q.args[0].args else None
        if not (isinstance(convs, fx.Node) and is_call(convs, CONVS) and len(convs.args) == 15 and not convs.kwargs):
            continue
        conv_states, conv_pending, conv_num, xs, weights = (convs.args[0:3], convs.args[3:6], convs.args[6],
                                                            convs.args[7:10], convs.args[10:13])
        conv_parents, silu = convs.args[13:15]
        _, value_heads, dk, dv = example_value(state).shape
        heads = (_conv_head(q, convs, 0, (None, dk)) and _conv_head(k, convs, 1, (None, dk))
                 and _conv_head(v, convs, 2, (value_heads, dv), alone=False))
        if not heads or (conv_num, conv_parents) != (num_pending, parents):
            continue
        if any(order[user] < order[verify] for user in v.users):
            continue  # (v's heads are the pass's v record too: the fused op returns them)
        if any(not is_call(user, (operator.getitem,)) for user in convs.users):
            continue
        records = getitem_users(convs)
        if any(len(records.get(i, ())) != 1 for i in range(3)):
            continue  # (a conv's output taken twice: read elsewhere)
        if any(order[user] < order[verify] for i in (3, 4, 5) for rec in records.get(i, ()) for user in rec.users):
            continue  # (a record read before the recurrence, where the fused op makes it)
        between = [n for n in graph.nodes if order[convs] < order[n] < order[verify]]
        if any(written_tensors(n) or any(s in n.all_input_nodes for s in conv_states) for n in between):
            continue  # (the fused op reads the convs' inputs later, and commits their states later, than the convs did)
        with graph.inserting_before(verify):
            fused = graph.call_function(CONVS_FOLDED, (list(conv_states), list(conv_pending), list(xs), list(weights),
                                                       silu, state, *pending, num_pending, a, b, a_log, dt_bias, parents,
                                                       scale, use_qk_l2norm))
            v_heads = graph.call_function(operator.getitem, (fused, 4))
            copies = {i: graph.call_function(operator.getitem, (fused, i + 2)) for i in records if i >= 3}
        v.replace_all_uses_with(v_heads)
        for i, copy in copies.items():
            for node in records[i]:
                node.replace_all_uses_with(copy)
        verify.replace_all_uses_with(fused)
        for node in (verify, q, k, v, *(n for rec in records.values() for n in rec), convs):
            graph.erase_node(node)
        fill_example_values(graph, fake_mode)
        order = {node: i for i, node in enumerate(graph.nodes)}
        folded += 1
    return recompiled(gm, folded)
