"""Cost of one EAGLE drafting iteration (``propose`` + ``commit``) on the CPU: aten ops, host syncs, time.

A small random fla GDN target (vocabulary 32000, as the trained one) and an untrained head, batch 1,
greedy. Every iteration commits the pending token and the first two drafted tokens with stand-in
features (the drafter's cost does not depend on their values). Counts per ``propose`` are taken with a
``TorchDispatchMode``: ``ops`` every aten call (each one a kernel launch or more on a GPU), ``syncs``
the device-to-host reads (``item``, ``int(tensor)``: ``_local_scalar_dense``), ``host_tensors`` the
tensors built from Python data (``torch.tensor(list)``: a host-to-device copy on a GPU);
``attention_shapes`` is the number of distinct attention problems seen over all measured iterations
(on an H100/H200 each new one costs a cuDNN plan build, tens of ms, in masked bf16 attention).
``cpu_ms`` is CPU time per propose + commit (process time: the model's own compute included, other
processes on the machine excluded). Reported at two sequence lengths: nothing but the attention should
grow with it.

    python benchmarks/eagle_draft_cpu.py
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from specla_compile import SpecConfig
from specla_compile.runtime.drafters import EagleConfig, EagleDrafter, EagleHead
from specla_compile.runtime.drafting import DraftRequest

CONFIGS = {
    "chain d8": SpecConfig(mode="chain", depth=8),
    "tree k4 d6 b15": SpecConfig(mode="tree", depth=6, tree_top_k=4, budget=15),
}


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.attention_shapes: set[tuple] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        self.ops[name] += 1
        if "scaled_dot_product" in name:
            self.attention_shapes.add((tuple(args[0].shape), tuple(args[1].shape)))
        return func(*args, **(kwargs or {}))

    def summary(self, calls: int) -> dict[str, float]:
        return {
            "ops": sum(self.ops.values()) / calls,
            "syncs": self.ops["aten._local_scalar_dense"] / calls,
            "host_tensors": self.ops["aten.lift_fresh"] / calls,
            "attention_shapes": len(self.attention_shapes),
        }


def make_drafter(hidden: int = 256, vocab: int = 32000, seed: int = 0) -> EagleDrafter:
    from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM

    import specla_compile  # noqa: F401  (routes fla's GPU-only kernels to references on CPU)

    torch.manual_seed(seed)
    target = GatedDeltaNetForCausalLM(
        GatedDeltaNetConfig(hidden_size=hidden, num_hidden_layers=1, num_heads=4, vocab_size=vocab, fuse_cross_entropy=False)
    ).eval()
    return EagleDrafter(EagleHead(EagleConfig.for_target(target)).eval(), target)


def measure(drafter: EagleDrafter, config: SpecConfig, length: int, iterations: int) -> dict:
    """Start a row at ``length - 1`` tokens, then ``iterations`` of propose + commit."""
    gen = torch.Generator().manual_seed(1)
    hidden = drafter.head.config.hidden_size
    seq = torch.randint(0, drafter.vocab_size, (length,), generator=gen)
    drafter.begin([seq[:-1]], [torch.randn(length - 1, hidden, generator=gen)])
    drafter.propose(DraftRequest([0], [seq]), config)  # the prompt's pairs: once per generate, not timed
    drafter.commit([0], [seq[-1:]], [torch.randn(1, hidden, generator=gen)])
    seq = torch.cat([seq, seq[-1:]])
    seconds, counter = 0.0, OpCounter()
    for _ in range(iterations):
        start = time.process_time()
        with counter:
            draft = drafter.propose(DraftRequest([0], [seq]), config)
        accepted = draft.tokens[0, 1:3] if config.mode == "chain" else draft.tokens[0, 1:2]
        committed = torch.cat([seq[-1:], accepted])
        drafter.commit([0], [committed], [torch.randn(len(committed), hidden, generator=gen)])
        seconds += time.process_time() - start
        seq = torch.cat([seq, accepted, accepted[:1]])  # (the last token is the new pending one)
    return {"length": length, **counter.summary(iterations), "cpu_ms": round(1e3 * seconds / iterations, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--lengths", type=int, nargs="+", default=[200, 1000])
    parser.add_argument("--hidden", type=int, default=256, help="target (and head) width; small = host overhead alone")
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    drafter = make_drafter(args.hidden, args.vocab)
    with torch.no_grad():
        for name, config in CONFIGS.items():
            for length in args.lengths:
                measure(drafter, config, length, 3)  # warm-up
                print(name, measure(drafter, config, length, args.iterations), flush=True)


if __name__ == "__main__":
    main()
