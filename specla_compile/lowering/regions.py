"""Regional compilation of a verification twin: one program per distinct layer, reused down the stack.

Inductor lowers a 24-layer twin as one graph, so its time grows with the depth (17-34 s per bucket on an
H200, most of a cold start). The layers of a stack are the same code on different weights and states,
so :func:`compile_by_layer` splits the graph at its decoder layers (``nn_module_stack``'s ``layers.<i>``),
compiles the first layer of each shape once and calls that program for every layer with the same graph
and inputs of the same layout. A region ends after the next layer's input norm, so the residual add and
that norm still fuse; the pass's CUDA graph covers every region alike. Twins with symbolic sizes are not
split (a region's program is compiled for its first call's shapes).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Sequence

import torch
import torch.fx as fx
from torch.fx.passes.split_module import split_module

log = logging.getLogger("specla_compile")

_LAYER = re.compile(r"\blayers\.(\d+)\b")
Compile = Callable[[fx.GraphModule, list], Callable]  # (region, its real inputs) -> the compiled region


def layer_regions(gm: fx.GraphModule) -> dict[fx.Node, int]:
    """Region of every computing node. Region ``i + 1`` holds decoder layer ``i`` after its first module
    (its input norm) and the first module of layer ``i + 1``, so that the residual add ending one layer and the
    norm starting the next stay in one program (one fused kernel, as in the whole graph); region 0 holds
    what runs before that (the embedding, layer 0's input norm), the last layer's region the final norm, and
    the last region the modules after it (the head). Any other node (the rewrite's own, a getitem, the model's code
    between layers) joins the region of the node before it; regions never decrease along the graph, so no
    region needs a later one."""
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    where = {n: _layer_of(n) for n in nodes}
    first_module: dict[int, str] = {}
    for node in nodes:
        if where[node] is not None:
            first_module.setdefault(*where[node])
    tagged = [i for i, n in enumerate(nodes) if where[n] is not None]
    last = tagged[-1] if tagged else len(nodes)
    after_layers = max(first_module, default=-1) + 2
    regions: dict[fx.Node, int] = {}
    current, final_norm = 0, None
    for i, node in enumerate(nodes):
        if where[node] is not None:
            layer, module = where[node]
            current = max(current, layer if module == first_module[layer] else layer + 1)
        elif i > last and node.meta.get("nn_module_stack"):
            # the first module after the layers (the final norm) ends the last layer's region, as the next
            # layer's input norm ends the others'
            module = _module_path(node)
            final_norm = final_norm or module
            if module != final_norm:
                current = max(current, after_layers)
        regions[node] = current
    return regions


def _module_path(node: fx.Node) -> str:
    return list(node.meta["nn_module_stack"].values())[-1][0]


def _layer_of(node: fx.Node) -> tuple[int, str] | None:
    """The index of the decoder layer whose module ran ``node``, and that module's name inside the layer
    (empty: the layer's own code), if any."""
    paths = [path for path, _ in (node.meta.get("nn_module_stack") or {}).values() if isinstance(path, str)]
    found = [(m, path) for path in paths if (m := _LAYER.search(path))]
    if not found:
        return None
    match, path = found[-1]
    return int(match.group(1)), path[match.end() :].lstrip(".").split(".")[0]


def structure_key(gm: fx.GraphModule, inputs: Sequence) -> tuple | None:
    """What a compiled region depends on: its graph up to node names, and every input's layout. None for
    a region that holds constants or submodules of its own (never shared)."""
    index: dict[fx.Node, int] = {}
    nodes = []
    for i, node in enumerate(gm.graph.nodes):
        if node.op in ("get_attr", "call_module"):
            return None
        index[node] = i
        args = fx.node.map_arg((node.args, node.kwargs), lambda n: f"%{index[n]}")
        nodes.append((node.op, "" if node.op == "placeholder" else str(node.target), repr(args)))
    storages: dict[int, int] = {}  # which inputs share memory: AOTAutograd compiles for that aliasing
    layouts = tuple(
        (tuple(x.shape), x.stride(), x.storage_offset(), x.dtype, str(x.device), x.data_ptr() % 16 == 0,
         storages.setdefault(x.untyped_storage().data_ptr(), i))
        if isinstance(x, torch.Tensor) else repr(x)
        for i, x in enumerate(inputs)
    )
    return tuple(nodes), layouts


class _Region(torch.nn.Module):
    """One region of the split graph: compiled at its first call (from its real inputs), or the program
    of an earlier region with the same structure."""

    def __init__(self, graph: fx.GraphModule, programs: dict, compile_region: Compile, stats: dict):
        super().__init__()
        self.graph, self.programs, self.compile_region, self.stats = graph, programs, compile_region, stats
        self.program: Callable | None = None
        # Inductor compiles graphs that return a tuple; split_module returns a region's single value bare
        # (its ``tuple_return`` flag is missing before torch 2.13), so wrap it here and unwrap per call.
        output = graph.graph.output_node()
        self.bare = not isinstance(output.args[0], (tuple, list))
        if self.bare:
            output.args = ((output.args[0],),)
            graph.recompile()

    def forward(self, *args):
        if self.program is None:
            key = structure_key(self.graph, args)
            self.program = self.programs.get(key) if key is not None else None
            if self.program is None:
                started = time.perf_counter()
                self.program = self.compile_region(self.graph, list(args))
                self.stats["compiled"] += 1
                self.stats["seconds"] += time.perf_counter() - started
                if key is not None:
                    self.programs[key] = self.program
            else:
                self.stats["reused"] += 1
        result = self.program(*args)
        return result[0] if self.bare else result


def compile_by_layer(gm: fx.GraphModule, compile_region: Compile, name: str = "twin") -> fx.GraphModule:
    """``gm`` split into regions (:func:`layer_regions`), each compiled by ``compile_region`` at the first
    call unless a region of the same structure already was; logs the count after the first call."""
    regions = layer_regions(gm)
    split = split_module(gm, None, regions.__getitem__, keep_original_order=True)
    programs: dict[tuple, Callable] = {}
    stats = {"compiled": 0, "reused": 0, "seconds": 0.0}
    for child, graph in list(split.named_children()):
        setattr(split, child, _Region(graph, programs, compile_region, stats))

    def first_call(module, args, output):
        log.info("specla: the %s's %d regions: %d compiled in %.1f s, %d calling an earlier region's program",
                 name, stats["compiled"] + stats["reused"], stats["compiled"], stats["seconds"], stats["reused"])
        handle.remove()

    handle = split.register_forward_hook(first_call)
    return split
