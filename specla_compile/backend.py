"""The ``specla`` torch.compile backend.

``torch.compile(model, backend="specla", options={...})`` — registered through the
``torch_dynamo_backends`` entry point, so no import is needed first. For every graph Dynamo captures
it compiles two programs with the inner compiler: the graph as captured (a plain call behaves like the
eager model) and, when the graph has GDN layers reading a cache, its verification twin
(:mod:`.lowering.rewrite`). Each call runs the twin inside ``VerifySession.verify`` and the plain
graph otherwise; the draft topology is data, so new trees of the same size reuse both programs. A graph
with symbolic sizes traced for the static engine gets a static twin per size instead, compiled at the
size's first call.

Options: ``inner`` — ``"inductor"`` (default), ``"aot_eager"`` or ``"eager"``; ``verify_kernel`` —
``"auto"`` (default: the CUDA dispatch's cost model) or ``"serial"``, ``"parallel"``, ``"hybrid"``
to force that Triton route; ``plain`` — ``"compiled"`` (default) or ``"eager"``: plain calls (outside
verification) run the captured graph as it is, uncompiled, which halves the compile time of a model
that only verifies (what :class:`~specla_compile.SpeculativeGenerator` asks for when it compiles the
model itself: it prefills with the eager model); ``fuse_projections`` — True (default): projections
that read one input and whose weights lie back to back in memory (:func:`~specla_compile.lowering.
fuse_projections.pack_projections`, which the generator runs) become one GEMM each; ``combo_kernels`` —
True (default): on CUDA, inductor launches independent pointwise kernels as one (its ``combo_kernels``);
``fold_norms`` — False (default): True runs, on CUDA, each bf16 RMS norm of a static twin of up to 32 tokens inside
the GEMM after it, with the residual add before it (:mod:`.lowering.fold_norms`; slower than inductor's norm and
cuBLAS at the 1.3B shape on an H200 so far, ``fold_gpu.md``); ``fold_gated_norms`` — True (default): on
CUDA, the one-token twin's (the plain step at B=1) gated output norms of a bf16 GDN layer run inside its o_proj, one
launch of a one-row GEMV where the heads fit it (:func:`.lowering.fold_norms.fold_gated_norms`,
``kernels/triton_gemv.py``); ``fold_gated_norms_drafted`` — False (default; slower: on an H100 the 16-node passes 1.11x the defaults' with
the gates' fold below, ``e2e_gpu_fold_ab_h100.md``): those of
the twins of 2-32 tokens too, one launch of a few-row kernel (``kernels/triton_linear.py``); ``fold_gates`` — True
(default): on CUDA, the gate and beta of each fla GDN layer are computed inside the recurrence's launch in the
static twins of one node a row (plain decoding's step; :mod:`.lowering.fold_gates`). The two cut the 1.3B shape's
1-node pass on an H200 from 1.503-1.513 to 1.420 ms (``e2e_gpu.md``, ``fold_ab_327f184``); ``fold_convs`` — False (default; no faster on an H200: plain decoding 1.455
against 1.450 ms/token, ``fold_ab``): True also runs the q/k/v short convs inside that launch
(:func:`.lowering.fold_gates.fold_convs`); ``fold_gates_drafted`` — False (default; slower, as the drafted norms' fold above: the 32-node tree 1.32x):
the gates of the twins of more nodes whose passes all take the parallel route (by the default cost model, more than
6 nodes) computed inside its launch; ``fold_swiglu`` — True (default): on CUDA, the one-token twin's (B=1) bf16 MLP
``silu(gate) * up`` runs inside its down projection, one launch of the same one-row
GEMV (:func:`.lowering.fold_norms.fold_swiglu`; on an H200 plain decoding 1.450 -> 1.357 ms/token, ``fold_ab``);
``fold_swiglu_drafted`` — True (default): that product of the twins of 2-16 tokens (drafted passes, prefill passes,
plain steps at B > 1) inside one launch of a few-row kernel that splits the down projection's depth and sums its
slices itself, where inductor's product, cuBLAS's split-K GEMM and its reduction run three
(``kernels/triton_linear.swiglu_linear``; on an H100 the 9-node chain's pass 0.975x the time without it, the 16-node
chain and tree 0.976x and 0.971x, ``benchmarks/results/swiglu_drafted_h100``; not yet timed on an H200); ``triton_linears`` — False (default): True runs, on
CUDA, each other bf16 GEMM of such a twin (and the MLP's ``silu(gate) * up`` after it) as specla's Triton kernel,
which launches with PDL on Hopper (:func:`.lowering.fold_norms.route_linears`); ``cuda_gemvs`` — False (default; on an H100 plain decoding 0.968x the defaults' time a token, drafted passes
unchanged, ``e2e_gpu_fold_ab_h100.md``; not yet timed so on an H200, and its library is built for sm_90 only): True
runs, on CUDA, the one-token twin's (B=1) bf16 GEMMs, with the gated norms, MLP products and the residual adds and
RMS norms before them folded into them, as a one-row GEMV in CUDA C that issues its weight loads before it waits for
the kernel before (:func:`.lowering.fold_norms.fold_row_norms`, :func:`.lowering.fold_norms.route_row_gemvs`,
``kernels/cuda_gemv.cu``, built with the machine's ``nvcc`` in a background thread while the twins compile); ``regional`` — True (default):
compiles each static twin one decoder layer at a time, one program per distinct layer reused down the stack
(:mod:`.lowering.regions`: on an H200 the 1.3B shape's cold start 127.6 -> 89.6 s, passes as fast; regions cut
after the next layer's input norm, so the residual add and that norm still fuse); False compiles each twin whole. A
max-autotune ``mode`` on CUDA needs ``fuse_projections=False`` (inductor's GEMM autotuner cannot read a fused weight). ``mode`` is passed to inductor, except for its CUDA graphs: the
:class:`~specla_compile.runtime.engine.StaticEngine` captures whole passes itself (on CUDA by default,
``mode="reduce-overhead"`` included; ``SpecConfig(cuda_graphs=False)`` turns them off).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from collections.abc import Callable, Sequence

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from .backend_options import INNER_COMPILERS, OPTIONS, PLAIN_PROGRAMS, SWITCHES
from .kernels import cuda_gemv, dispatch, ops
from .lowering.capture import install
from .lowering.fold_gates import fold_convs, fold_gates
from .lowering.fold_norms import (
    fold_gated_norms,
    fold_norms,
    fold_row_norms,
    fold_swiglu,
    route_linears,
    route_row_gemvs,
)
from .lowering.fuse_projections import fuse_projections, gathers_as_slices
from .lowering.graph_analysis import fill_example_values, find_gdn_layers, is_sdpa
from .lowering.regions import compile_by_layer
from .lowering.rewrite import VerifyProgram, rewrite_for_verify
from .lowering.session import LayerBinding, VerifySession, active_session

log = logging.getLogger("specla_compile")


def _inner_compiler(inner: str, mode: str | None, combo_kernels: bool = True) -> Callable:
    if inner not in INNER_COMPILERS:
        raise ValueError(f"specla option 'inner' must be one of {INNER_COMPILERS}, got {inner!r}")
    if inner == "eager":
        return lambda gm, example_inputs: gm.forward
    if inner == "aot_eager":
        return torch._dynamo.lookup_backend("aot_eager")
    from torch._inductor.compile_fx import compile_fx

    patches = torch._inductor.list_mode_options(mode) if mode else {}
    # CUDA graphs are the engine's job (runtime/engine.py captures whole passes, acceptance included);
    # inductor's own graphs would nest inside that capture
    patches["triton.cudagraphs"] = False

    def compile_inner(gm: fx.GraphModule, example_inputs: Sequence) -> Callable:
        # on CUDA, one launch for independent pointwise kernels (a GDN layer's gate and beta): at B=1 a
        # pass is bound by launches, and the 1.3B shape's 1-node pass went 1.704 -> 1.662 ms on an H200;
        # and inductor's kernels launch with PDL where specla's do (kernels/pdl.py)
        device = _cuda_device(example_inputs)
        if device is None:
            return compile_fx(gm, example_inputs, config_patches=patches)
        from .kernels import pdl  # (imports Triton, which CUDA implies)

        on_gpu = {**patches, **pdl.launch_bound_inductor_options(device), "combo_kernels": combo_kernels}
        return compile_fx(gm, example_inputs, config_patches=on_gpu)

    return compile_inner


def _fake_verify_inputs(program: VerifyProgram, example_inputs: Sequence) -> list:
    """Fake values of the twin's extra inputs, for compiling it now (in the example inputs' fake mode),
    and, in the graph's own fake mode, as the example values of their placeholders and of every node
    the rewrite added (:func:`~.lowering.graph_analysis.fill_example_values`)."""
    placeholders = [n for n in program.graph_module.graph.nodes if n.op == "placeholder"]
    first_layer = next(n for n in program.graph_module.graph.nodes if "gdn_commit_verify_" in str(n.target))
    q = first_layer.args[6].meta["example_value"]
    batch, nodes = q.shape[0], q.shape[1]
    device = q.device

    def make() -> list:
        extras = [
            torch.empty(batch, nodes, dtype=torch.long, device=device),
            torch.empty(batch, dtype=torch.long, device=device),
        ]
        if program.needs_tree_mask:
            sdpa = next(n for n in program.graph_module.graph.nodes if is_sdpa(n))
            keys = sdpa.args[1].meta["example_value"]
            extras.append(torch.empty(batch, 1, nodes, keys.shape[-2], dtype=torch.bool, device=device))
        for layer in program.layers:
            extras += [torch.empty(batch, nodes, *r.feature_shape, dtype=r.dtype, device=device) for r in layer.records]
        return extras

    # the compiler's inputs live in the example inputs' fake mode, the graph's example values in the
    # graph's own (Dynamo's): the extras are made once in each
    fake_mode = torch._guards.detect_fake_mode(example_inputs)
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        extras = make()
    graph_mode = getattr(q, "fake_mode", None)
    with graph_mode if graph_mode is not None else contextlib.nullcontext():
        for placeholder, value in zip(placeholders[program.num_model_inputs :], make()):
            placeholder.meta["example_value"] = value
    fill_example_values(program.graph_module.graph, graph_mode)
    return extras


def _dense_indices(values: Sequence) -> list:
    """``values`` with their integer and boolean tensors (token ids, positions, parents, masks; never states) made
    dense. The twins are compiled for, and called with, such dense copies: a drafter's token ids and parents are
    often slices of wider buffers, and inductor's code asserts the layout it was compiled for at every call."""
    return [v.contiguous() if isinstance(v, torch.Tensor) and not v.is_floating_point() else v for v in values]


def _has_symbolic_size(value) -> bool:
    return isinstance(value, torch.SymInt) or (isinstance(value, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in value.shape))


class SpeculativeGraph:
    """What the backend returns for one captured graph: runs the plain program, or the verification
    twin while a :class:`VerifySession` is verifying.

    A graph with symbolic sizes traced for the static engine (its one graph for every bucket size) gets one
    static twin per size, compiled at its first call from the call's own inputs (as vLLM compiles its
    sizes): Dynamo traces the model once for every size, and inductor sees static shapes (its Triton code
    generation fails on a dynamic node dimension on the H200). Other sessions (a growing cache: a new
    attention length every pass) keep one dynamic twin."""

    def __init__(self, gm: fx.GraphModule, example_inputs: Sequence, compile_inner: Callable, verify_kernel: str = "auto",
                 plain: str = "compiled", switches: dict[str, bool] | None = None):
        self.verify_kernel = verify_kernel
        self.switches = {**SWITCHES, **(switches or {})}
        started = time.perf_counter()
        self.plain = compile_inner(gm, example_inputs) if plain == "compiled" else gm.forward
        self.compile_seconds = {"plain": time.perf_counter() - started}
        self.program: VerifyProgram | None = None
        self.verify_fn: Callable | None = None
        self.unverifiable = ""
        try:
            self.program = rewrite_for_verify(gm)
        except ValueError as err:
            self.unverifiable = str(err)
            log.info("specla: graph %s compiled without a verification twin: %s", gm.__class__.__name__, err)
            return
        extras = _fake_verify_inputs(self.program, example_inputs)
        self.compile_inner = compile_inner
        self.twins: dict[tuple, Callable] = {}  # static twin per size, of a graph with symbolic sizes
        self.size_inputs = []
        session = active_session()
        if session is not None and session.static:  # the engine's static buffers: a few sizes, one per bucket
            self.size_inputs = [i for i, value in enumerate(example_inputs) if _has_symbolic_size(value)]
        if self.size_inputs:
            return
        started = time.perf_counter()
        self.verify_fn = compile_inner(self.program.graph_module, [*_dense_indices(example_inputs), *extras])
        self.compile_seconds["verify"] = time.perf_counter() - started
        log.info("specla: compiled a graph of %d GDN layers: plain program %.1f s, verification twin %.1f s",
                 len(self.program.layers), self.compile_seconds["plain"], self.compile_seconds["verify"])

    def __call__(self, *args):
        session = active_session()
        if session is None:
            return self.plain(*args)
        if self.program is None:
            raise RuntimeError(f"specla cannot verify through this graph: {self.unverifiable}")
        return self._verify(session, args)

    def _parallel_at(self, nodes: int) -> bool:
        """Whether every pass of ``nodes`` nodes takes the parallel route: forced by ``verify_kernel``, or so by the
        cost model even for a chain (which favours the walking routes most). One twin serves every bucket of its size,
        whatever each bucket's topology, and its op re-decides the route at each call."""
        forced = contextlib.nullcontext() if self.verify_kernel == "auto" else dispatch.use_route(self.verify_kernel)
        with forced, dispatch.topology_hint(dispatch.TopologyHint.chain(nodes)):
            return dispatch.choose_route(nodes) == "parallel"

    def _twin_for(self, inputs: list, tokens: int) -> Callable:
        """The static twin of these inputs' sizes (``tokens``: batch rows times draft nodes), compiled at the first
        call of a size."""
        key = tuple(inputs[i] if isinstance(inputs[i], int) else tuple(inputs[i].shape) for i in self.size_inputs)
        twin = self.twins.get(key)
        if twin is None:
            started = time.perf_counter()
            program = self.program.graph_module  # (a copy per size: inductor's passes edit the graph they get)
            gm = fx.GraphModule(program, copy.deepcopy(program.graph))
            gathers_as_slices(gm)
            on = {name for name, value in self.switches.items() if value} if _on_cuda(inputs) else set()  # (CUDA only)
            if ("fold_gated_norms" if tokens == 1 else "fold_gated_norms_drafted") in on:  # (a kernel for each)
                log.info("specla: %d gated norms folded into the o_proj after them", fold_gated_norms(gm, rows=tokens))
            if ("fold_swiglu" if tokens == 1 else "fold_swiglu_drafted") in on:  # (a kernel for each)
                folded = fold_swiglu(gm, rows=tokens)
                log.info("specla: %d MLPs' silu(gate) * up folded into their down projection", folded)
            if tokens == 1 and "cuda_gemvs" in on:  # (its kernel takes one row)
                folded = fold_row_norms(gm)
                log.info("specla: %d residual adds and norms folded into the CUDA C GEMV after them", folded)
                log.info("specla: %d GEMMs routed to the CUDA C GEMV", route_row_gemvs(gm))
            nodes = inputs[self.program.num_model_inputs].shape[1]  # (the first input the rewrite added: parents [B, N])
            if "fold_gates" in on and nodes == 1:  # (its kernel runs one node a row: plain decoding)
                log.info("specla: %d GDN layers' gates folded into their recurrence", fold_gates(gm, nodes))
                if "fold_convs" in on:
                    log.info("specla: %d GDN layers' q/k/v convs folded into their recurrence", fold_convs(gm))
            elif "fold_gates_drafted" in on and self._parallel_at(nodes):  # (its kernel takes them)
                folded = fold_gates(gm, nodes, drafted=True)
                log.info("specla: %d GDN layers' gates folded into their parallel verify", folded)
            if tokens <= ops.LINEAR_MAX_ROWS:
                if "fold_norms" in on:
                    log.info("specla: %d norms folded into the GEMMs after them", fold_norms(gm))
                if "triton_linears" in on:
                    log.info("specla: %d GEMMs routed to specla's linear kernels", route_linears(gm))
            if self.switches["regional"]:
                twin = self.twins[key] = compile_by_layer(gm, self._compile_static, f"verification twin for sizes {key}")
                return twin  # (its regions compile at its first call, and log their time then)
            twin = self.twins[key] = self._compile_static(gm, inputs)
            self.compile_seconds[f"verify {key}"] = time.perf_counter() - started
            log.info("specla: compiled the verification twin of a graph of %d GDN layers for sizes %s in %.1f s",
                     len(self.program.layers), key, self.compile_seconds[f"verify {key}"])
        return twin

    def _compile_static(self, gm: fx.GraphModule, inputs: Sequence) -> Callable:
        """Compile ``gm`` for these inputs' static shapes."""
        # fake inputs of static shapes in a mode with a shape env, as Dynamo hands them over: without
        # one, AOTAutograd's and inductor's caches bypass the graph ("No shape env")
        fake_mode = FakeTensorMode(shape_env=ShapeEnv())
        fakes = [fake_mode.from_tensor(x, static_shapes=True) if isinstance(x, torch.Tensor) else x for x in inputs]
        with torch._guards.tracing(torch._guards.TracingContext(fake_mode)):
            return self.compile_inner(gm, fakes)

    def _verify(self, session: VerifySession, args: Sequence) -> tuple:
        program = self.program
        parents, tree_mask = session.draft.parents, session.draft.tree_mask
        batch, nodes = parents.shape
        device = parents.device
        extras: list[torch.Tensor] = [parents, session.pending_count(batch, device)]
        if program.needs_tree_mask:
            if tree_mask is None:
                raise ValueError("this model has full-attention layers: VerifySession.verify needs a tree_mask")
            extras.append(tree_mask)
        elif tree_mask is not None:
            raise NotImplementedError(
                "a tree_mask was given but no scaled_dot_product_attention call takes it: load the model with "
                "attn_implementation='sdpa' or 'eager' (other attention implementations cannot verify trees yet)"
            )
        keys = []
        for layer in program.layers:
            state = args[layer.state_input]
            for method, view_args, view_kwargs in layer.state_views:
                state = getattr(state, method)(*view_args, **view_kwargs)
            key = args[layer.state_input].data_ptr()
            keys.append(key)
            session.layers[key] = LayerBinding(state, [args[i] for i in layer.conv_state_inputs])
            shapes = [(r.feature_shape, r.dtype) for r in layer.records]
            extras += session.take_pending(key, batch, nodes, shapes, device)
        inputs = _dense_indices([*args, *extras])
        verify_fn = self.verify_fn or self._twin_for(inputs, batch * nodes)
        if self.verify_kernel == "auto":
            outputs = verify_fn(*inputs)
        else:
            with dispatch.use_route(self.verify_kernel):
                outputs = verify_fn(*inputs)
        records = outputs[program.num_model_outputs :]
        for key, layer in zip(keys, program.layers):
            session.records[key], records = list(records[: len(layer.records)]), records[len(layer.records) :]
        return outputs[: program.num_model_outputs]


def specla_backend(gm: fx.GraphModule, example_inputs: Sequence, mode: str | None = None, options: dict | None = None) -> Callable:
    """Dynamo backend: see the module docstring."""
    install()
    options = dict(options or {})
    unknown = set(options) - OPTIONS
    if unknown:
        raise ValueError(f"unknown specla options {sorted(unknown)}; known: {sorted(OPTIONS)}")
    switches = {name: options.get(name, default) for name, default in SWITCHES.items()}
    for name, value in switches.items():
        if not isinstance(value, bool):
            raise ValueError(f"specla option {name!r} must be True or False, got {value!r}")
    if switches["cuda_gemvs"] and cuda_gemv.nvcc() is None:
        raise ValueError("specla option 'cuda_gemvs' builds its GEMV with nvcc, which is neither on the PATH nor in "
                         "$CUDA_HOME/bin")
    if switches["cuda_gemvs"] and torch.cuda.is_available():
        cuda_gemv.prebuild()  # (nvcc's half minute beside the compilation of the twins, not before the first pass)
    compile_inner = _inner_compiler(options.get("inner", "inductor"), mode, switches["combo_kernels"])
    verify_kernel = options.get("verify_kernel", "auto")
    if verify_kernel != "auto" and verify_kernel not in dispatch.ROUTES:
        raise ValueError(f"specla option 'verify_kernel' must be 'auto' or one of {dispatch.ROUTES}, got {verify_kernel!r}")
    plain = options.get("plain", "compiled")
    if plain not in PLAIN_PROGRAMS:
        raise ValueError(f"specla option 'plain' must be one of {PLAIN_PROGRAMS}, got {plain!r}")
    if not find_gdn_layers(gm.graph):
        log.info("specla: graph with no GDN layer, compiled normally with %s", options.get("inner", "inductor"))
        return compile_inner(gm, example_inputs)
    if switches["fuse_projections"]:
        groups = fuse_projections(gm, example_inputs)
        log.info("specla: %d groups of projections reading one input became one GEMM each", groups)
        if groups and _tunes_gemms_on_cuda(options.get("inner", "inductor"), mode, example_inputs):
            # (measured on an H200: inductor's autotuner rebuilds a fused GEMM's weight, an as_strided view
            # over its first part's graph input, at that part's size, and fails minutes into the compile)
            raise ValueError(f"specla: mode={mode!r} cannot autotune the fused projection GEMMs on CUDA; pass "
                             "options={'fuse_projections': False} to tune the unfused ones, or another mode")
    return SpeculativeGraph(gm, example_inputs, compile_inner, verify_kernel, plain, switches)


def _cuda_device(example_inputs: Sequence) -> torch.device | None:
    return next((x.device for x in example_inputs if isinstance(x, torch.Tensor) and x.is_cuda), None)


def _on_cuda(example_inputs: Sequence) -> bool:
    return _cuda_device(example_inputs) is not None


def _tunes_gemms_on_cuda(inner: str, mode: str | None, example_inputs: Sequence) -> bool:
    """Whether inductor will autotune this graph's GEMMs on CUDA (a max-autotune ``mode``, or its config set so)."""
    config = torch._inductor.config
    tunes = (mode is not None and torch._inductor.list_mode_options(mode).get("max_autotune", False)) or (
        config.max_autotune or config.max_autotune_gemm)
    return inner == "inductor" and bool(tunes) and _on_cuda(example_inputs)


def _register_by_name() -> None:
    """Make ``backend="specla"`` work from a source checkout too (no installed entry point); when the
    entry point exists, Dynamo registers the backend from it and this stays out of its way."""
    from torch._dynamo.backends import registry

    if "specla" not in registry._COMPILER_FNS and registry._BACKENDS.get("specla") is None:
        registry.register_backend(specla_backend, name="specla")


_register_by_name()
