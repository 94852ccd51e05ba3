"""The one-row GEMV in CUDA C (``cuda_gemv.cu``): built with the machine's ``nvcc`` into a shared library, once per
source, flags and compiler, and launched through ctypes on the caller's CUDA stream (so a CUDA graph being captured
there records it). ``specla::row_gemv``'s and ``specla::add_norm_row_gemv``'s CUDA kernel where the backend's
``cuda_gemvs`` option routes the plain step's GEMMs to it, with the MLP's ``silu(gate) * up``, the GDN layer's gated
output norm or a block's residual add and RMS norm as its prologue (``lowering/fold_norms.route_row_gemvs`` and
``fold_row_norms``), and ``benchmarks/gemv_cuda_gpu.py``'s subject.

Every lane issues all of its weight loads before it waits for the kernel before (PDL) and reads x: on an H200 one
layer's four GEMMs of the GDN-1.3B shape took 33.7 us against cuBLAS's 42.3 (``benchmarks/results/gemv_cuda_gpu.md``).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading

import torch

log = logging.getLogger("specla_compile")

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda_gemv.cu")
FLAGS = ["-O3", "-arch=sm_90", "-shared", "-Xcompiler", "-fPIC"]
# K / 256 of the depths the library has instances for, and the most rows a warp holds at each (128 registers)
CHUNK_ROWS = {4: (1, 2, 4, 8), 8: (1, 2, 4), 16: (1, 2), 22: (1,)}
PROLOGUES = ("none", "swiglu", "gated_norm", "add_norm")  # how x is formed (cuda_gemv.cu's Prologue codes, in order)


def nvcc() -> str | None:
    """The CUDA compiler: on the PATH, else under ``CUDA_HOME`` (default ``/usr/local/cuda``); None without one."""
    found = shutil.which("nvcc") or os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
    return found if os.path.isfile(found) else None


def build(directory: str | None = None) -> ctypes.CDLL:
    """Compile ``cuda_gemv.cu`` into a shared library in ``directory`` (default: ``specla_cuda_gemv`` in the temporary
    directory), unless one of the same source, flags and compiler is there, and load it."""
    compiler = nvcc()
    if compiler is None:
        raise RuntimeError("the CUDA GEMV needs nvcc (on the PATH or in $CUDA_HOME/bin)")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    with open(SOURCE, "rb") as f:
        digest = hashlib.sha1(f.read() + " ".join(FLAGS).encode() + version.encode()).hexdigest()[:12]
    directory = directory or os.path.join(tempfile.gettempdir(), "specla_cuda_gemv")
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"cuda_gemv_{digest}.so")
    if not os.path.exists(path):
        log.info("specla: building the CUDA GEMV with nvcc into %s (once per source and compiler, about 30 s)", path)
        partial = f"{path}.{os.getpid()}.tmp"  # (per process: pytest-xdist's workers build at once)
        subprocess.run([compiler, *FLAGS, "-o", partial, SOURCE], check=True)
        os.replace(partial, path)
    lib = ctypes.CDLL(path)
    lib.specla_gemv.restype = ctypes.c_int
    lib.specla_gemv.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 8 + [ctypes.c_float, ctypes.c_int, ctypes.c_void_p]
    return lib


_built: list[ctypes.CDLL] = []  # (the process's library, once built)
_failed: list[Exception] = []  # (or why its build failed: not tried again in this process)
_building = threading.Lock()
_prebuilding: list[threading.Thread] = []


def library() -> ctypes.CDLL:
    """The process's library: built at the first call, which later calls (from any thread) wait for. A build that
    failed is not tried again (nvcc's half minute on every call): later calls raise its error."""
    with _building:
        if _failed:
            raise RuntimeError(f"building the CUDA GEMV failed earlier in this process: {_failed[0]}") from _failed[0]
        if not _built:
            try:
                _built.append(build())
            except Exception as error:
                _failed.append(error)
                raise
        return _built[0]


def prebuild() -> threading.Thread | None:
    """Start :func:`library`'s build in a background thread, so that nvcc's half minute overlaps what the caller
    compiles meanwhile (the backend's ``cuda_gemvs``: its verification twins); the first launch waits for it. Nothing
    to do (None) where the library is built, its build failed, or a background build is under way. A failed build is
    logged here and raised by the launch's call of :func:`library`."""
    if _built or _failed or any(thread.is_alive() for thread in _prebuilding):
        return None

    def build_now() -> None:
        try:
            library()
        except Exception as error:  # noqa: BLE001 (any failure: logged here, raised by the launch's call)
            log.warning("specla: building the CUDA GEMV in the background failed: %s", error)

    thread = threading.Thread(target=build_now, name="specla-cuda-gemv-build", daemon=True)
    _prebuilding[:] = [thread]
    thread.start()
    return thread


def depth_fits(k: int) -> bool:
    """Whether the library has instances for rows ``k`` deep."""
    return k % 256 == 0 and k // 256 in CHUNK_ROWS


def config(n: int, k: int) -> tuple[int, int, int]:
    """(rows per warp, warps per block, streaming loads) for ``W [n, k]``, by the H200's best of each GDN-1.3B shape
    with PDL (``gemv_cuda_gpu.md``): 4 rows a warp for o_proj's 2048, 2 for q/k/v/gates' 8208, 1 for gate/up's 11264,
    down (5632 deep) and the LM head, as deep rows allow; 8 warps; loads that skip L1."""
    rows = 4 if n <= 4096 else 2 if n <= 10000 else 1
    return min(rows, max(CHUNK_ROWS[k // 256])), 8, 1


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous tensors share bytes."""
    return a.data_ptr() < b.data_ptr() + b.nbytes and b.data_ptr() < a.data_ptr() + a.nbytes


def gemv(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, rows: int = 2, warps: int = 8, streaming: int = 0,
         pdl: int = 0, prologue: str = "none", gate: torch.Tensor | None = None,
         norm_weight: torch.Tensor | None = None, eps: float = 0.0, sum_out: torch.Tensor | None = None,
         round_sum: bool = False) -> None:
    """``y = w @ x`` for bf16 ``w [N, K]`` (row-major, ``depth_fits(K)``), ``x [K]`` and ``y [N]``, on the current
    stream; x formed by ``prologue`` (``PROLOGUES``): ``"swiglu"`` from ``[gate, up]`` (``x [2K]``); ``"gated_norm"``
    from a row of heads of D values and its ``gate`` (both ``[K]``) with ``norm_weight [D]`` and ``eps``;
    ``"add_norm"``, the RMS norm (``norm_weight [K]``, ``eps``) of ``h = x + gate`` (the skip, ``[K]``) summed in fp32,
    or rounded to bf16 first with ``round_sum``, writing h rounded to ``sum_out [K]``. Raises ValueError for a shape or
    configuration the library has no instance of, RuntimeError for a CUDA error."""
    n, k = w.shape
    width = 2 * k if prologue == "swiglu" else k
    extras = (gate, norm_weight) if prologue in ("gated_norm", "add_norm") else ()
    extras += (sum_out,) if prologue == "add_norm" else ()
    tensors = (w, x, y, *extras)
    if not (prologue in PROLOGUES and all(t is not None and t.is_cuda and t.is_contiguous() and t.dtype == torch.bfloat16
                                          for t in tensors)
            and x.shape == (width,) and y.shape == (n,) and (not extras or gate.shape == (k,))
            and (prologue != "add_norm" or norm_weight.shape == sum_out.shape == (k,))
            and not any(_overlap(out, t) for out in (y, sum_out) if out is not None
                        for t in (x, gate, sum_out if out is y else None) if t is not None)
            and all(t.data_ptr() % 16 == 0 for t in (w, x, *extras))):
        raise ValueError(f"gemv takes contiguous, 16-byte aligned bf16 CUDA tensors w [N, K], x [{width}] and y [N] (and "
                         f"for the norms a gate or skip [K], a norm weight, and for the add a sum [K]), the outputs apart "
                         f"from x and the gate (blocks write them while others read), a prologue in {PROLOGUES}; got "
                         f"{tuple(w.shape)}, {tuple(x.shape)}, {tuple(y.shape)}, {prologue!r}")
    dim = norm_weight.numel() if extras else 0
    if len({t.device for t in tensors}) > 1:
        raise ValueError(f"gemv takes its tensors on one GPU, got {sorted({str(t.device) for t in tensors})}")
    pointers = [t.data_ptr() if t is not None else None for t in (gate, norm_weight, sum_out)] if extras else [None] * 3
    with torch.cuda.device(w.device):  # (the launch goes to the current device's stream)
        code = library().specla_gemv(w.data_ptr(), x.data_ptr(), *pointers, y.data_ptr(), n, k, rows, warps, streaming,
                                     pdl, PROLOGUES.index(prologue), dim, eps, int(round_sum),
                                     torch.cuda.current_stream(w.device).cuda_stream)
    if code == -1:
        raise ValueError(f"no GEMV instance for K={k}, {rows} rows per warp, {warps} warps, prologue {prologue!r}"
                         + (f", heads of {dim}" if extras else ""))
    if code:
        raise RuntimeError(f"GEMV launch failed: CUDA error {code}")


def weight_fits(weight: torch.Tensor, dtype: torch.dtype, width: int, prologue: str, dim: int | None = None,
                norm_weight: torch.Tensor | None = None) -> bool:
    """Whether :func:`row_gemv` takes ``weight`` for rows of ``dtype`` and ``width`` (``"swiglu"``: ``[gate, up]``,
    twice the weight's depth; ``"gated_norm"``: heads of ``dim`` values, a multiple of 8; ``"add_norm"``: one head,
    the row, ``dim`` its width; the norms with a contiguous bf16 ``norm_weight`` of ``dim`` values): a contiguous bf16
    weight of an instanced depth (the fold's test, on example values: their rows may be symbolic, their addresses are
    not the run's)."""
    k = weight.shape[-1]
    heads_fit = prologue not in ("gated_norm", "add_norm") or (
        dim is not None and dim % 8 == 0 and k % dim == 0 and (prologue == "gated_norm" or dim == k)
        and norm_weight is not None and norm_weight.dtype == torch.bfloat16 and norm_weight.is_contiguous()
        and norm_weight.numel() == dim)
    return (weight.dim() == 2 and weight.is_contiguous() and depth_fits(k) and width == (2 * k if prologue == "swiglu" else k)
            and dtype == weight.dtype == torch.bfloat16 and heads_fit)


def fits(x: torch.Tensor, weight: torch.Tensor, prologue: str, gate: torch.Tensor | None = None,
         norm_weight: torch.Tensor | None = None) -> bool:
    """Whether :func:`row_gemv` (``"add_norm"``: :func:`add_norm_row_gemv`) takes these: one row of ``x``
    (``"gated_norm"``: of ``[..., H, D]`` heads), for the norms a ``gate`` (the skip of ``"add_norm"``) like it and a
    contiguous bf16 norm weight of D values (the row's width for ``"add_norm"``), a weight of at least one row that
    :func:`weight_fits` it, all on one GPU and 16-byte aligned."""
    tensors = [t for t in (x, weight, gate, norm_weight) if t is not None]
    if prologue not in PROLOGUES or weight.shape[0] < 1 or len({t.device for t in tensors}) > 1 or not x.is_cuda:
        return False
    if prologue in ("none", "swiglu"):
        return (x.numel() == x.shape[-1] and weight_fits(weight, x.dtype, x.shape[-1], prologue)
                and x.data_ptr() % 16 == weight.data_ptr() % 16 == 0)
    if gate is None or norm_weight is None or (prologue == "gated_norm" and x.dim() < 2):
        return False
    heads, dim = x.shape[-2:] if prologue == "gated_norm" else (1, x.shape[-1])
    return (x.numel() == heads * dim and gate.shape == x.shape and gate.dtype == x.dtype
            and weight_fits(weight, x.dtype, heads * dim, prologue, dim, norm_weight)
            and all(t.data_ptr() % 16 == 0 for t in (x, gate, norm_weight, weight)))


def row_gemv(x: torch.Tensor, weight: torch.Tensor, prologue: str, pdl: bool, gate: torch.Tensor | None = None,
             norm_weight: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    """``specla::row_gemv`` on CUDA for a contiguous x (and gate) that :func:`fits`: ``[..., K]`` (``"swiglu"``:
    ``[..., 2K]``; ``"gated_norm"``: ``[..., H, D]``) -> ``[..., N]``."""
    rows = x.shape[:-2] if prologue == "gated_norm" else x.shape[:-1]
    y = x.new_empty(*rows, weight.shape[0])
    gemv(weight, x.view(-1), y.view(-1), *config(*weight.shape), pdl=int(pdl), prologue=prologue,
         gate=None if gate is None else gate.view(-1), norm_weight=norm_weight, eps=eps)
    return y


def add_norm_row_gemv(x: torch.Tensor, skip: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                      round_sum: bool, pdl: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``specla::add_norm_row_gemv`` on CUDA for a contiguous row and skip that :func:`fits` (``"add_norm"``):
    ``([..., N], [..., K])``, the GEMV of the normalised sum and the sum rounded."""
    y, summed = x.new_empty(*x.shape[:-1], weight.shape[0]), torch.empty_like(x)
    gemv(weight, x.view(-1), y.view(-1), *config(*weight.shape), pdl=int(pdl), prologue="add_norm", gate=skip.view(-1),
         norm_weight=norm_weight, eps=eps, sum_out=summed.view(-1), round_sum=round_sum)
    return y, summed
