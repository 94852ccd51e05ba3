"""Fuse the linear projections that read the same input into one GEMM (gpt-fast's ``wqkv``).

A decode or verify pass reads every weight once for a handful of rows, so it is bound by how well its
GEMMs stream their weights: a GDN layer's q/k/v/a/b/gate projections and its MLP's gate/up each read
the same normalized input in separate, small GEMMs. Two steps turn each such group into one GEMM:

1. :func:`pack_projections` (before compiling) runs the model once, finds the ``nn.Linear`` modules that
   receive the same input tensor, and makes their weights views of one concatenated weight (same
   values, no second copy; the eager model reads the same memory).
2. :func:`fuse_projections` (the backend's FX pass) replaces each group of ``linear`` calls on one input
   whose weights lie back to back in one storage by one ``linear`` over that storage (an ``as_strided``
   view of the first weight), split afterwards. Nothing is copied per call.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Sequence

import torch
import torch.fx as fx

LINEAR = (torch._C._nn.linear, torch.nn.functional.linear)


@torch.no_grad()
def pack_projections(model: torch.nn.Module, example_input_ids: torch.Tensor) -> int:
    """Make the weights of the bias-free ``nn.Linear`` layers that read one input tensor (in a forward
    over ``example_input_ids``) views of one concatenated weight each; returns the number of groups."""
    readers: dict[int, list[torch.nn.Linear]] = defaultdict(list)
    keep_alive = []  # the inputs, so that their ids stay unique during the forward

    def record(module, args):
        keep_alive.append(args[0])
        readers[id(args[0])].append(module)

    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m.bias is None]
    hooks = [m.register_forward_pre_hook(record) for m in linears]
    try:
        model(input_ids=example_input_ids, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    groups = 0
    for modules in readers.values():
        weights = list(dict.fromkeys(m.weight for m in modules))  # a layer called twice counts once
        if (len(weights) < 2 or len({(w.dtype, w.device, w.shape[1]) for w in weights}) != 1
                or any(type(w.detach()) is not torch.Tensor for w in weights)  # e.g. DTensors of a sharded model
                or _back_to_back(weights)):  # packed before
            continue
        fused = torch.cat([w.detach() for w in weights])
        for w, part in zip(weights, fused.split([w.shape[0] for w in weights])):
            w.data = part
        groups += 1
    return groups


def _back_to_back(weights: Sequence[torch.Tensor]) -> bool:
    """Whether the 2-D ``weights`` lie back to back, in order, in one storage (plain tensors only)."""
    first = weights[0]
    if any(type(w.detach()) is not torch.Tensor for w in weights):  # e.g. DTensors of a sharded model
        return False
    offset = first.storage_offset()
    for w in weights:
        if w.dim() != 2 or not w.is_contiguous() or w.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() or w.storage_offset() != offset:
            return False
        offset += w.numel()
    return True


def linear_parts(node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """``(input, weight)`` of a bias-free ``linear`` call, else None."""
    if node.op != "call_function" or node.target not in LINEAR or len(node.args) < 2:
        return None
    bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    return None if bias is not None else (node.args[0], node.args[1])


def _join_example_values(fused: fx.Node, parts: Sequence[fx.Node]) -> None:
    """Give the fused GEMM Dynamo's example value of its parts, joined. Computing it by running the
    fused ``linear`` on the symbolic fake input instead reads the input's sizes as integers on CUDA (a
    guard ``Eq(nodes, N)`` that specialises the one graph of every bucket size to one size)."""
    values = [part.meta.get("example_value") for part in parts]
    if any(not isinstance(v, torch.Tensor) for v in values):
        return
    with getattr(values[0], "fake_mode", None) or contextlib.nullcontext():  # (the graph's mode, not the inputs')
        fused.meta["example_value"] = torch.cat(values, -1)


def fuse_projections(gm: fx.GraphModule, example_inputs: Sequence) -> int:
    """Replace, in place, every group of two or more bias-free ``linear`` calls on one input node whose
    weights (graph inputs) lie back to back in one storage (:func:`pack_projections`) by one ``linear``
    and a split. Returns the number of groups fused."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    value = dict(zip(placeholders, example_inputs))
    groups: dict[fx.Node, list[fx.Node]] = defaultdict(list)
    for node in gm.graph.nodes:
        parts = linear_parts(node)
        if parts is not None and isinstance(value.get(parts[1]), torch.Tensor):
            groups[parts[0]].append(node)
    fused = 0
    for nodes in groups.values():
        weights = [value[n.args[1]] for n in nodes]
        if len(nodes) < 2 or not _back_to_back(weights):
            continue
        first = weights[0]
        rows, width = sum(w.shape[0] for w in weights), first.shape[1]
        with gm.graph.inserting_before(nodes[0]):  # graph order: the input exists, no use comes earlier
            weight = gm.graph.call_function(torch.as_strided, (nodes[0].args[1], (rows, width), (width, 1), first.storage_offset()))
            out = gm.graph.call_function(torch._C._nn.linear, (nodes[0].args[0], weight))
            _join_example_values(out, nodes)
            stack = list((nodes[0].meta.get("nn_module_stack") or {}).items())
            for made in (weight, out):  # the module calling the projections (regions.py splits by module)
                made.meta["nn_module_stack"] = dict(stack[:-1])
            start = 0
            for node, w in zip(nodes, weights):
                # a gather of the columns, not a split: a strided view of the output makes the fake-tensor
                # cache test the node dimension for size 1, which would specialise every bucket's graph
                columns = gm.graph.call_function(torch.arange, (start, start + w.shape[0]), {"device": first.device})
                part = gm.graph.call_function(torch.index_select, (out, -1, columns))
                part.meta = dict(node.meta)
                node.replace_all_uses_with(part)
                start += w.shape[0]
        for node in nodes:
            gm.graph.erase_node(node)
        fused += 1
    if fused:
        gm.recompile()
    return fused


def gathers_as_slices(gm: fx.GraphModule) -> int:
    """In a graph of static shapes (a per-size twin, where no guard can specialise), turn the column
    gathers that :func:`fuse_projections` splits the fused output with back into slices: views, which
    the ops reading them take as they are, where each gather was a copy kernel per part. Returns the
    number of gathers replaced."""
    replaced = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not torch.index_select or node.args[1] != -1:
            continue
        columns = node.args[2]
        if not (isinstance(columns, fx.Node) and columns.target is torch.arange and len(columns.args) == 2):
            continue
        start, end = columns.args
        with gm.graph.inserting_before(node):
            part = gm.graph.call_function(torch.narrow, (node.args[0], -1, start, end - start))
        part.meta = dict(node.meta)
        node.replace_all_uses_with(part)
        gm.graph.erase_node(node)
        if not columns.users:
            gm.graph.erase_node(columns)
        replaced += 1
    if replaced:
        gm.recompile()
    return replaced
