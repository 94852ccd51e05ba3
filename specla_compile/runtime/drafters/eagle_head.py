"""The EAGLE-style draft head: its config, the module, checkpoint I/O and the training loss.

Position ``t`` of the head reads the pair (target feature f_t, embedding of token x_{t+1}), fuses
the concatenation with a linear layer, runs one Transformer decoder layer (RoPE self-attention and a
SwiGLU MLP, pre-norm) and predicts the next feature f_{t+1}; the target's own LM head turns that
prediction into logits for x_{t+2}. The target's input embeddings and LM head are used, frozen, and
never stored in the head's checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from ...kernels import ops
from ...kernels import reference as ref
from ..drafting import output_vocab_size


class HeadGemms(NamedTuple):
    """A packed head's GEMMs with the norms, residuals and gate around them, and a tree level's LM head with its
    top-k (signatures of ``ops``)."""

    linear_add: Callable[..., torch.Tensor]
    norm_linear: Callable[..., torch.Tensor]
    norm_gated_linear: Callable[..., torch.Tensor]
    linear_top_k: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None  # (None: the tree builder's scores, then top-k)
    down_add: Callable[..., torch.Tensor]  # (hidden, weight, residual, weight_scale) -> residual + hidden @ weight^T
    # (each takes an int8 weight's per-row scale as its last argument, ``weight_scale``: ``ref.scaled_linear``)


def _add_after_down(hidden: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor,
                    weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The down projection as PyTorch code: the framework's GEMM, then the residual as its own add (which inductor
    fuses with what follows; inside the GEMM as addmm it took cuBLAS's bias-epilogue kernel, 3.4 us more per chain
    level on the H200). An int8 weight: specla's GEMM (the framework's has no int8 weight of bf16 rows)."""
    if weight_scale is not None:
        return residual + ops.linear(hidden, weight, weight_scale)
    return residual + F.linear(hidden, weight)


def _down_add(hidden: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor,
              weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The down projection as ``specla::linear_add`` where its kernel splits the weight's depth
    (``ops.linear_split``): the residual in the GEMM's launch, where cuBLAS's split-K runs a GEMM and a reduction
    and the add a third kernel; as PyTorch code elsewhere."""
    if ops.linear_split(weight) > 1:
        return ops.linear_add(hidden, weight, None, residual, None, weight_scale)
    return _add_after_down(hidden, weight, residual, weight_scale)


def _after_norm(gemm: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``(x, norm_weight, eps, weight, weight_scale) -> gemm(rms_norm(x), weight, weight_scale)``: the norm as PyTorch
    code (one small inductor kernel), the GEMM as a specla op. At hidden 2048 on the H200 a norm inside the GEMM's
    weight loop costs 4 us a call, a norm kernel before it 2 (``benchmarks/results/fold_gpu_head.md``)."""
    return lambda x, norm_weight, eps, weight, weight_scale=None: gemm(
        F.rms_norm(x, (x.shape[-1],), norm_weight, eps), weight, weight_scale)


# as specla ops (one Triton launch each on CUDA), or as the PyTorch code they stand for (which inductor fuses)
HEAD_GEMMS = {"specla": HeadGemms(ops.linear_add, ops.norm_linear, ops.norm_gated_linear, ops.linear_top_k, _down_add),
              "pytorch": HeadGemms(ref.linear_add_reference, ref.norm_linear_reference, ref.norm_gated_linear_reference,
                                   None, _add_after_down),
              # specla's linear_add for the two 1024-column GEMMs (the fuse, o_proj), where cuBLAS's kernel at 4 rows
              # streams their 2 MB in 5-8 us (H200 propose profile) against linear_add's 4-5 us; PyTorch's for the rest
              "mixed": HeadGemms(ops.linear_add, ref.norm_linear_reference, ref.norm_gated_linear_reference,
                                 None, _add_after_down),
              # specla's GEMMs throughout (gate/up with silu(gate) * up), the norms PyTorch's: at the 1.3B-sized
              # head the bare Triton GEMMs stream q/k/v in 8.9 us against cuBLAS's 9.4 and gate/up with the gate
              # in 17.5 against cuBLAS's and inductor's 21.9 (fold_gpu_head.md, 24 weights in one graph)
              "triton": HeadGemms(ops.linear_add, _after_norm(ops.linear), _after_norm(ops.gated_linear),
                                  ops.linear_top_k, _down_add)}
# the default: on the H200 a depth-6 tree's propose (draft vocabulary 8192) replays in 0.349 ms with "triton"
# against 0.369 with "mixed" at the trained head's shape (hidden 1024), 0.554 against 0.582 at the 1.3B-sized head
# (benchmarks/results/eagle_profile{,_gdn13b}_head_gemms_triton.md; chains alike, 0.381 against 0.402 and 0.655
# against 0.687); with the levels' linear_top_k and (at hidden 1024) the split down projection, 0.322 against 0.369
# and 0.540 against 0.584 (eagle_profile_linear_top_k.md, eagle_profile_gdn13b_linear_top_k.md). "mixed" had
# replaced "pytorch" the same way (0.362 against 0.419 ms, eagle_profile_head_gemms.md; end to end 2.27x against
# 2.20x in one trained study); "specla" drafted no faster than "pytorch" (its norm-fused
# launches cost what cuBLAS's and inductor's kernels cost together)
DEFAULT_HEAD_GEMMS = "triton"
INT8_HEAD_GEMMS = ("triton", "specla")  # those whose every GEMM is a specla op, which takes int8 weights

# a packed head's GEMM weights as int8 and their per-row scales, by name (EagleHead.int8_weights)
Int8Weights = dict[str, tuple[torch.Tensor, torch.Tensor]]


def _streamed(int8: Int8Weights | None, name: str, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(weight, scale)`` a GEMM streams: the int8 copy of ``name`` and its scale, or ``weight`` itself and None."""
    return (int8 or {}).get(name, (weight, None))

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


@dataclass
class EagleConfig:
    """Shape of an EAGLE head; ``hidden_size`` and ``vocab_size`` must equal the target's.

    ``acceptance_temperature``: the temperature at which the head's next-token probabilities estimate the
    chance that the target's greedy token is that token (:func:`fit_acceptance_temperature`, on held-out text,
    by ``examples/train_eagle.py``). The head learns the target's whole distribution, which is much flatter
    than the target's argmax is predictable; tree drafts rank their nodes by these sharper probabilities."""

    hidden_size: int
    vocab_size: int
    num_heads: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    acceptance_temperature: float = 1.0

    def __post_init__(self) -> None:
        for name in ("hidden_size", "vocab_size", "num_heads", "intermediate_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"EagleConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not self.acceptance_temperature > 0:  # (also rejects NaN)
            raise ValueError(f"EagleConfig.acceptance_temperature must be > 0, got {self.acceptance_temperature}")
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 2:
            raise ValueError(
                f"hidden_size {self.hidden_size} must split into {self.num_heads} heads of an even size (RoPE)"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def for_target(cls, target: nn.Module, **overrides: float) -> EagleConfig:
        """A head sized after ``target``: its hidden size and vocabulary, its attention head count
        when that gives even head sizes (else 64-wide heads), its MLP width when it has one."""
        hidden = target.get_input_embeddings().weight.shape[1]
        cfg = getattr(target, "config", None)
        heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "num_heads", None)
        if not heads or hidden % heads or (hidden // heads) % 2:
            heads = max(1, hidden // 64)
        values = {
            "hidden_size": hidden,
            "vocab_size": output_vocab_size(target),
            "num_heads": heads,
            "intermediate_size": getattr(cfg, "intermediate_size", None) or 4 * hidden,
            "rms_norm_eps": getattr(cfg, "rms_norm_eps", None) or getattr(cfg, "norm_eps", None) or 1e-6,
        }
        values.update(overrides)
        return cls(**values)

    def check_target(self, target: nn.Module) -> None:
        """Raise ``ValueError`` unless this head's hidden size and vocabulary match ``target``'s."""
        hidden = target.get_input_embeddings().weight.shape[1]
        vocab = output_vocab_size(target)
        if (hidden, vocab) != (self.hidden_size, self.vocab_size):
            raise ValueError(
                f"EAGLE head was built for hidden_size={self.hidden_size}, vocab_size={self.vocab_size} but the "
                f"target has hidden_size={hidden}, vocab_size={vocab}"
            )


def _rope(positions: torch.Tensor, half: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's ``cos, sin [R, 1, S, half]`` at integer ``positions [R, S]`` (angles in float64)."""
    inv_freq = theta ** (-torch.arange(half, device=positions.device, dtype=torch.float64) / half)
    angle = (positions[:, None, :, None].double() * inv_freq).to(dtype)
    return angle.cos(), angle.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE (rotate-half layout) of ``x [R, H, S, d]``."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class EagleHead(nn.Module):
    """One decoder layer over fused (feature, next-token embedding) pairs; predicts the next feature."""

    def __init__(self, config: EagleConfig):
        super().__init__()
        self.config = config
        d, i = config.hidden_size, config.intermediate_size
        self.fuse = nn.Linear(2 * d, d)
        self.attn_norm = nn.RMSNorm(d, eps=config.rms_norm_eps)
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(d, d, bias=False) for _ in range(3))
        self.o_proj = nn.Linear(d, d, bias=False)
        self.mlp_norm = nn.RMSNorm(d, eps=config.rms_norm_eps)
        self.gate_proj, self.up_proj = nn.Linear(d, i, bias=False), nn.Linear(d, i, bias=False)
        self.down_proj = nn.Linear(i, d, bias=False)
        # inference copies of q/k/v and gate/up as one weight each (pack_projections); never saved
        self.register_buffer("qkv_weight", None, persistent=False)
        self.register_buffer("gate_up_weight", None, persistent=False)
        # inference, with the target's embedding (pack_projections(embed)): every token's embedding through the
        # fuse's embedding half [V, D], and the fuse's feature half [D, D]; never saved
        self.register_buffer("token_fuse", None, persistent=False)
        self.register_buffer("feature_fuse_weight", None, persistent=False)
        # every token id, most frequent in the head's training data first (set by the trainer, saved with the
        # head): the first N of them are a draft vocabulary (EagleDrafter's ``draft_vocab``)
        self.register_buffer("token_ranking", None)

    @torch.no_grad()
    def pack_projections(self, embed: nn.Module | None = None) -> None:
        """For inference: copy the q/k/v weights into one and the gate/up weights into one, so that
        :meth:`project` and :meth:`attend` run one GEMM for each group (a draft level reads these small
        weights for a few rows: each GEMM is latency-bound). With the target's input ``embed``, also pass every
        token's embedding through the fuse's embedding half once (``token_fuse [V, D]``, in fp32, rounded to
        the head's dtype): :meth:`project` then takes token ids and its fuse reads a ``D x D`` weight plus one
        table row per pair instead of a ``2D x D`` weight (on the H200 a 2048-deep GEMM of a few rows costs
        about twice a 1024-deep one). Packed, :meth:`project` and :meth:`attend` run the GEMMs with the norms,
        residuals, table rows and gate around them through their ``gemms`` (``DEFAULT_HEAD_GEMMS``'s by default, the
        ``specla::`` ops on request; inference only: the packed weights get no gradient). The parameters stay what training and checkpoints use; call it
        again after changing them."""
        self.qkv_weight = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])
        self.gate_up_weight = torch.cat([self.gate_proj.weight, self.up_proj.weight])
        self.token_fuse = self.feature_fuse_weight = None
        if embed is not None:
            d = self.config.hidden_size
            self.token_fuse = (embed.weight.float() @ self.fuse.weight[:, :d].float().T).to(self.fuse.weight.dtype)
            self.feature_fuse_weight = self.fuse.weight[:, d:].contiguous()

    @torch.no_grad()
    def int8_weights(self) -> Int8Weights:
        """Weight-only int8 copies of a packed head's GEMM weights (the fuse's feature half where a token table
        is packed, q/k/v, o_proj, gate/up, down), each row scaled by its largest magnitude
        (``reference.quantize_rows``), for :meth:`project` and :meth:`attend`: half the bytes a draft level reads.
        A draft head only proposes, so their rounding moves acceptance, never the output."""
        if self.qkv_weight is None:
            raise ValueError("EagleHead.int8_weights: pack_projections() first")
        weights = {"fuse": self.feature_fuse_weight, "qkv": self.qkv_weight, "o": self.o_proj.weight,
                   "gate_up": self.gate_up_weight, "down": self.down_proj.weight}
        return {name: ref.quantize_rows(w) for name, w in weights.items() if w is not None}

    def forward(
        self, features: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Run ``S`` pairs per row: ``features, embeds [R, S, D]``; ``positions [R, S]``; ``mask [R or 1, S,
        S]`` (True = may attend). Returns the predicted next features ``[R, S, D]`` and the pairs' keys and
        values ``[R, H, S, d]`` (RoPE applied). A caller with cached keys uses :meth:`project` and
        :meth:`attend` around its own buffers."""
        x, q, k, v = self.project(features, embeds, positions)
        return self.attend(x, q, k, v, mask), k, v

    def project(
        self, features: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor, gemms: HeadGemms | None = None,
        int8: Int8Weights | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """First half of :meth:`forward`: the fused input ``x [R, S, D]`` and the pairs' queries, keys and
        values ``[R, H, S, d]`` (RoPE applied), for a caller that keeps its keys in its own buffers. ``embeds``:
        the tokens' embeddings ``[R, S, D]``, or their ids ``[R, S]`` once packed with the target's embedding.
        ``gemms``: how a packed head runs its GEMMs (one of ``HEAD_GEMMS``; default ``DEFAULT_HEAD_GEMMS``'s);
        ``int8``: the weights it streams instead (:meth:`int8_weights`; default: its own)."""
        gemms = gemms or HEAD_GEMMS[DEFAULT_HEAD_GEMMS]  # (read by a packed head only)
        rows, s, _ = features.shape
        heads, dim = self.config.num_heads, self.config.head_dim
        if embeds.is_floating_point():
            x = self.fuse(torch.cat([embeds, features], dim=-1))
        elif self.token_fuse is None:
            raise ValueError("EagleHead.project takes token ids only after pack_projections(embed); pass embeddings")
        else:  # (the table's rows added in the GEMM's epilogue)
            weight, scale = _streamed(int8, "fuse", self.feature_fuse_weight)
            x = gemms.linear_add(features, weight, self.fuse.bias, self.token_fuse, embeds, scale)
        split = lambda t: t.view(rows, s, heads, dim).transpose(1, 2)
        cos, sin = _rope(positions, dim // 2, self.config.rope_theta, x.dtype)
        if self.qkv_weight is None:
            h = self.attn_norm(x)
            q, k, v = self.q_proj(h), self.k_proj(h), self.v_proj(h)
        else:  # (the norm inside the GEMM's launch)
            q, k, v = gemms.norm_linear(x, self.attn_norm.weight, self.config.rms_norm_eps,
                                        *_streamed(int8, "qkv", self.qkv_weight)).chunk(3, dim=-1)
        # queries and keys rotated together: one set of elementwise ops, not two
        q, k = _rotate(torch.stack([split(q), split(k)]), cos, sin).unbind(0)
        return x, q, k, split(v)

    def attend(
        self, x: torch.Tensor, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
        attention: Callable[..., torch.Tensor] | None = None, gemms: HeadGemms | None = None,
        int8: Int8Weights | None = None,
    ) -> torch.Tensor:
        """Second half of :meth:`forward`: ``q`` attends over ``keys, values [R, H, T, d]`` under ``mask
        [R or 1, S, T]``; returns the predicted next features ``[R, S, D]``. ``attention(q, keys, values,
        mask) -> [R, S, H, d]``, when given, replaces PyTorch's ``scaled_dot_product_attention`` (a drafter's
        own kernel, which writes the heads side by side as the output projection reads them). ``gemms``, ``int8``: as
        in :meth:`project`."""
        rows, s, _ = x.shape
        if attention is None:
            attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[:, None]).transpose(1, 2)
        else:
            attn = attention(q, keys, values, mask)
        if self.gate_up_weight is None:
            x = x + self.o_proj(attn.reshape(rows, s, -1))
            h = self.mlp_norm(x)
            return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))
        # packed for inference: the residuals, the norm and the gate inside the GEMMs' launches
        gemms = gemms or HEAD_GEMMS[DEFAULT_HEAD_GEMMS]
        weight, scale = _streamed(int8, "o", self.o_proj.weight)
        x = gemms.linear_add(attn.reshape(rows, s, -1), weight, None, x, None, scale)
        hidden = gemms.norm_gated_linear(x, self.mlp_norm.weight, self.config.rms_norm_eps,
                                         *_streamed(int8, "gate_up", self.gate_up_weight))
        weight, scale = _streamed(int8, "down", self.down_proj.weight)
        return gemms.down_add(hidden, weight, x, scale)

    def save_pretrained(self, path: str | os.PathLike) -> None:
        """Write ``config.json`` and ``model.safetensors`` (the head's own weights only) to ``path``."""
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, CONFIG_NAME), "w") as f:
            json.dump({"model_type": "specla_eagle_head", **dataclasses.asdict(self.config)}, f, indent=2)
        save_file(
            {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}, os.path.join(path, WEIGHTS_NAME)
        )

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> EagleHead:
        """Load a head written by :meth:`save_pretrained`."""
        config_file, weights_file = os.path.join(path, CONFIG_NAME), os.path.join(path, WEIGHTS_NAME)
        if not (os.path.isfile(config_file) and os.path.isfile(weights_file)):
            raise ValueError(f"{path} is not an EAGLE head checkpoint (needs {CONFIG_NAME} and {WEIGHTS_NAME})")
        with open(config_file) as f:
            raw = json.load(f)
        if raw.pop("model_type", None) != "specla_eagle_head":
            raise ValueError(f"{config_file} does not describe an EAGLE head (model_type != 'specla_eagle_head')")
        head = cls(EagleConfig(**raw))
        state = load_file(weights_file)
        head.load_state_dict(state)  # (heads saved before the token ranking have none)
        return head.to(device=device, dtype=dtype or next(v.dtype for v in state.values() if v.is_floating_point()))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        key = prefix + "token_ranking"
        if self.token_ranking is None and key in state_dict:  # (a buffer registered as None expects no key)
            self.set_token_ranking(state_dict[key])
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def set_token_ranking(self, ranking: torch.Tensor) -> None:
        """Keep ``ranking``, every token id once, most frequent first (see ``token_ranking``)."""
        ranking = ranking.to(device=self.fuse.weight.device, dtype=torch.long)
        if ranking.shape != (self.config.vocab_size,) or not torch.equal(
            ranking.sort().values, torch.arange(self.config.vocab_size, device=ranking.device)
        ):
            raise ValueError(f"a token ranking must hold each of the {self.config.vocab_size} token ids once, "
                             f"got shape {tuple(ranking.shape)}")
        self.token_ranking = ranking


def has_token_ranking(path: str | os.PathLike) -> bool:
    """Whether the head saved in ``path`` keeps a token ranking: read from its weights file's header, no
    tensor loaded (a check before slow work)."""
    weights = os.path.join(path, WEIGHTS_NAME)
    if not os.path.isfile(weights):
        return False
    with safe_open(weights, "pt") as f:
        return "token_ranking" in f.keys()  # noqa: SIM118 (safe_open is not a mapping)


def rank_tokens(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Every token id by its count in ``token_ids`` (any shape), most frequent first (ties: lower id first)."""
    token_ids = token_ids.flatten().long().cpu()
    if token_ids.numel() and not 0 <= int(token_ids.min()) <= int(token_ids.max()) < vocab_size:
        raise ValueError(f"token ids must lie in [0, {vocab_size}), got [{int(token_ids.min())}, {int(token_ids.max())}]")
    counts = torch.bincount(token_ids, minlength=vocab_size)
    return torch.sort(counts, descending=True, stable=True).indices


def causal_mask(length: int, device: torch.device | str | None = None) -> torch.Tensor:
    """``[1, length, length]`` mask letting each position see itself and earlier positions."""
    return torch.ones(length, length, dtype=torch.bool, device=device).tril()[None]


def unrolled_predictions(head: EagleHead, features: torch.Tensor, embeds: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """The head's feature predictions over a block, run ``steps`` times on its own outputs, as drafting runs it
    (EAGLE-3's training-time test). ``features [B, L, D]`` are f_0..f_{L-1}, ``embeds [B, L, D]`` the embeddings
    of x_1..x_L. Step 1 reads pair t = (f_t, x_{t+1}) at position t under a causal mask and predicts f_{t+1}.
    Step s reads (its step s - 1 prediction of f_{t+s-1}, x_{t+s}) at position t + s - 1 and attends where a
    draft level s - 1 attends: to the real pairs 0..t (the cache) and to the pairs of steps 2..s at the same t
    (its draft ancestors and itself); it predicts f_{t+s}. Returns the predictions of each step, ``[B, L - s + 1,
    D]`` for step s."""
    length = features.shape[1]
    if not 1 <= steps < length:
        raise ValueError(f"unrolled steps must be in [1, {length - 1}] for a block of {length} pairs, got {steps}")
    device = features.device
    positions = torch.arange(length, device=device).expand(features.shape[0], length)
    predicted, keys, values = head(features, embeds, positions, causal_mask(length, device))
    out, unrolled = [predicted], []  # (unrolled: the mask's block over each later step's pairs)
    for s in range(2, steps + 1):
        n = length - s + 1
        t = torch.arange(n, device=device)
        x, q, k, v = head.project(out[-1][:, :n], embeds[:, s - 1 :], positions[:, :n] + s - 1)
        keys, values = torch.cat([keys, k], dim=2), torch.cat([values, v], dim=2)
        # the real pairs up to t; then, in each unrolled step's block, the column of the same t
        unrolled = [b[:n] for b in unrolled] + [t[:, None] == t[None, :]]
        real = torch.arange(length, device=device)[None, :] <= t[:, None]
        out.append(head.attend(x, q, keys, values, torch.cat([real, *unrolled], dim=1)[None]))
    return out


def _predictions(head: EagleHead, embed: nn.Module, input_ids: torch.Tensor, features: torch.Tensor,
                 unroll: int) -> list[torch.Tensor]:
    """The head's feature predictions on a block, step 1 to ``unroll`` (:func:`unrolled_predictions`)."""
    dtype = head.fuse.weight.dtype
    with torch.no_grad():
        embeds = embed(input_ids[:, 1:]).to(dtype)
    return unrolled_predictions(head, features[:, :-1].to(dtype), embeds, unroll)


@torch.no_grad()
def greedy_pairs(
    head: EagleHead, embed: nn.Module, lm_head: nn.Module, input_ids: torch.Tensor, features: torch.Tensor,
    target_logits: torch.Tensor, unroll: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The head's next-token logits ``[N, V]`` (fp32) at every position of a block and of each unrolled step, as
    drafting's levels see them, and the target's greedy token there ``[N]``: what
    :func:`fit_acceptance_temperature` calibrates on."""
    logits, labels = [], []
    for s, predicted in enumerate(_predictions(head, embed, input_ids, features, unroll), start=1):
        logits.append(lm_head(predicted.to(lm_head.weight.dtype)).float().flatten(0, 1))
        labels.append(target_logits[:, s:].argmax(-1).flatten())
    return torch.cat(logits), torch.cat(labels)


def fit_acceptance_temperature(logits: torch.Tensor, labels: torch.Tensor, low: float = 0.02, high: float = 50.0) -> float:
    """The temperature ``T`` in ``[low, high]`` that minimises the cross-entropy of ``labels [N]`` (the target's
    greedy tokens) under ``softmax(logits [N, V] / T)``: temperature scaling, with the greedy token as the label.
    Its derivative in ``1 / T``, ``E[z] - z_label`` under that softmax, increases (the loss is convex in ``1 / T``),
    so the root is bisected (in log space, 60 halvings)."""
    if logits.dim() != 2 or labels.shape != logits.shape[:1] or not len(labels):
        raise ValueError(f"logits must be [N, V] and labels [N] with N >= 1, got {tuple(logits.shape)} and {tuple(labels.shape)}")
    if not 0 < low < high:
        raise ValueError(f"need 0 < low < high, got {low} and {high}")
    z = logits.float()
    z = z - z.max(-1, keepdim=True).values
    label_z = z.gather(1, labels[:, None].long()).double().mean()

    def slope(beta: float) -> float:  # d/dbeta of mean(logsumexp(beta z) - beta z_label)
        return float((torch.softmax(beta * z, -1) * z).sum(-1).double().mean() - label_z)

    lo, hi = math.log(1 / high), math.log(1 / low)  # (bounds on log beta)
    if slope(math.exp(lo)) >= 0:
        return high
    if slope(math.exp(hi)) <= 0:
        return low
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if slope(math.exp(mid)) < 0 else (lo, mid)
    return 1 / math.exp((lo + hi) / 2)


def eagle_loss(
    head: EagleHead,
    embed: nn.Module,
    lm_head: nn.Module,
    input_ids: torch.Tensor,
    features: torch.Tensor,
    target_logits: torch.Tensor,
    cls_weight: float = 0.1,
    unroll: int = 1,
) -> tuple[torch.Tensor, dict[str, float]]:
    """EAGLE's training loss on a block ``input_ids [B, T]`` with the target's ``features [B, T, D]``
    (last hidden state) and ``target_logits [B, T, V]``: Smooth-L1 regression of the predicted
    feature onto f_{t+1}, plus ``cls_weight`` times the cross-entropy of the head's next-token
    distribution against the target's at t+1. ``unroll`` > 1 adds the same loss for the head run on its own
    predictions (:func:`unrolled_predictions`), averaged over the steps. Returns the loss and float statistics
    (reg, cls, top-1 agreement with the target, of step 1; ``top1_s`` of each later step s)."""
    if input_ids.dim() != 2 or input_ids.shape[1] < 2:
        raise ValueError(f"input_ids must be [batch, length >= 2], got {tuple(input_ids.shape)}")
    loss, stats = 0.0, {}
    predictions = _predictions(head, embed, input_ids, features, unroll)
    for s, predicted in enumerate(predictions, start=1):
        with torch.no_grad():
            target_probs = target_logits[:, s:].float().softmax(-1)
        reg = F.smooth_l1_loss(predicted.float(), features[:, s:].float())
        log_probs = torch.log_softmax(lm_head(predicted.to(lm_head.weight.dtype)).float(), dim=-1)
        cls = -(target_probs * log_probs).sum(-1).mean()
        agree = (log_probs.argmax(-1) == target_probs.argmax(-1)).float().mean()
        loss = loss + (reg + cls_weight * cls) / len(predictions)
        if s == 1:
            stats.update(reg=reg.item(), cls=cls.item(), top1=agree.item())
        else:
            stats[f"top1_{s}"] = agree.item()
    return loss, stats
