"""Triton kernel: the accepted path of many record tensors, gathered in a few launches.

After a static tree pass every GDN layer holds 7 fresh factor records ``[B, N, ...]`` (key, value, gate,
beta, three conv inputs), and the accepted path of each goes to its pending buffer ``[B, A, ...]``. One
gather kernel per record made 56 launches per pass at 8 layers (82 us of kernels on the H200), 168 at
24. Here the rows travel as 32-bit words (16-bit words or bytes where a row's size or alignment asks), up
to ``GROUP`` tensors per launch, handed to the kernel as tuples: one program per (output row, tensor).
Same result as ``reference.gather_paths_reference``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..tree import gather_nodes
from .pdl import launch_args, wait_upstream

GROUP = 16  # tensors per launch (each one more branch in the kernel)
BLOCK = 1024  # words a program moves per step


@triton.jit
def _gather_paths_kernel(index, srcs, dsts, words, src_row, src_node, dst_row, dst_node, A,
                         GROUP: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """Grid: (B * A, GROUP). Program (b * A + a, i) copies row ``index[b, a]`` of batch row ``b`` of
    ``srcs[i]`` to row ``a`` of ``dsts[i]`` (``words[i]`` words; strides in words)."""
    wait_upstream(USE_PDL)
    row, which = tl.program_id(0), tl.program_id(1)
    b = (row // A).to(tl.int64)
    a = (row % A).to(tl.int64)
    node = tl.maximum(tl.load(index + row), 0).to(tl.int64)  # -1 (past the path) reads node 0
    offs = tl.arange(0, BLOCK)
    for i in tl.static_range(GROUP):
        if which == i:
            src = srcs[i] + b * src_row[i] + node * src_node[i]
            dst = dsts[i] + b * dst_row[i] + a * dst_node[i]
            for start in range(0, words[i], BLOCK):
                m = start + offs < words[i]
                tl.store(dst + start + offs, tl.load(src + start + offs, mask=m), mask=m)


def _rows_contiguous(t: torch.Tensor) -> bool:
    """Whether each ``t[b, n]`` of ``t [B, N, ...]`` is one contiguous run of memory."""
    expected = 1
    for size, stride in reversed(list(zip(t.shape[2:], t.stride()[2:]))):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _widest_words(t: torch.Tensor) -> int:
    """The widest word (4, 2 or 1 bytes) that tiles ``t``'s rows, row and node strides and address."""
    row_bytes = t[0, 0].numel() * t.element_size()
    strides = [s * t.element_size() for s in t.stride()[:2]]
    for width in (4, 2):
        if not (row_bytes % width or t.data_ptr() % width or any(s % width for s in strides)):
            return width
    return 1


def _as_words(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t [B, N, ...]`` as ``[B, N, W]`` words of ``dtype`` (a view)."""
    flat = t.reshape(t.shape[0], t.shape[1], -1)
    if flat.shape[2] == 1:  # (a one-element row may carry any stride there; a dtype view needs 1)
        flat = flat.as_strided(flat.shape, (*flat.stride()[:2], 1))
    return flat.view(dtype)


WORD_DTYPES = {4: torch.int32, 2: torch.int16, 1: torch.uint8}


def gather_paths_(dsts: list[torch.Tensor], srcs: list[torch.Tensor], index: torch.Tensor) -> None:
    """``dsts[i][b, a] = srcs[i][b, index[b, a]]`` for every pair; pairs whose rows are not contiguous
    are gathered by PyTorch."""
    index = index.contiguous()
    batch, length = index.shape
    groups: dict[torch.dtype, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for dst, src in zip(dsts, srcs, strict=True):
        if (dst.dtype, dst.device, dst.shape[:2], dst.shape[2:], src.shape[0]) != (
                src.dtype, index.device, (batch, length), src.shape[2:], batch):
            raise ValueError(f"gather_paths_: cannot gather {tuple(src.shape)} {src.dtype} along a {tuple(index.shape)} "
                             f"path into {tuple(dst.shape)} {dst.dtype}")
        if dst.numel() == 0:
            continue
        if not (_rows_contiguous(dst) and _rows_contiguous(src)):
            dst.copy_(gather_nodes(src, index))
            continue
        word = WORD_DTYPES[min(_widest_words(dst), _widest_words(src))]
        groups.setdefault(word, []).append((_as_words(dst, word), _as_words(src, word)))
    for pairs in groups.values():
        for start in range(0, len(pairs), GROUP):
            part = pairs[start : start + GROUP]
            d, s = [p[0] for p in part], [p[1] for p in part]
            _gather_paths_kernel[(batch * length, len(part))](
                index, tuple(s), tuple(d), tuple(t.shape[2] for t in d),
                tuple(t.stride(0) for t in s), tuple(t.stride(1) for t in s),
                tuple(t.stride(0) for t in d), tuple(t.stride(1) for t in d),
                length, GROUP=len(part), BLOCK=BLOCK, **launch_args(index.device),
            )
