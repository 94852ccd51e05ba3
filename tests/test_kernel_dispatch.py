"""Route choice for the verify kernels: topology hints, the cost model, and the overrides."""

import pytest
import torch

from specla_compile.kernels import dispatch
from specla_compile.kernels.dispatch import CostModel, TopologyHint, choose_route, topology_hint, use_route


def test_hint_from_parents_takes_the_largest_row():
    parents = torch.tensor([
        [-1, 0, 1, 2, 3, -2, -2],  # chain of 5: height 5, no jumps, one chain
        [-1, 0, 0, 1, 1, 2, 5],  # tree: height 4 (0-2-5-6), jumps at nodes 2, 3, 4, 5, leaves 3, 4, 6
    ])
    hint = TopologyHint.from_parents(parents)
    assert hint == TopologyHint(num_nodes=7, height=5, jumps=4, chains=3)  # height from row 0, the rest from row 1


def test_chain_hint():
    assert TopologyHint.chain(8) == TopologyHint.from_parents(torch.arange(-1, 7)[None])


def test_cheapest_route_wins():
    costs = CostModel({"serial": (0.0, 1.0, 5.0), "hybrid": (2.0, 1.0, 0.01), "parallel": (10.0, 0.0)})
    assert choose_route(6, costs) == "serial"  # a chain of 6: 6 < 8.06 < 10
    with topology_hint(TopologyHint(num_nodes=32, height=5, jumps=20, chains=4)):
        assert choose_route(32, costs) == "hybrid"  # 8.28 < 10 < 132
    with topology_hint(TopologyHint(num_nodes=64, height=40, jumps=30, chains=4)):
        assert choose_route(64, costs) == "parallel"
    assert choose_route(6, costs) == "serial"  # the hint ended with its block


def test_h200_choices_follow_the_measurements():
    """The committed H200 run: short chains go serial, longer chains and every Table 1 tree parallel."""
    assert [choose_route(n) for n in (1, 2, 4)] == ["serial"] * 3
    assert [choose_route(n) for n in (8, 12, 16)] == ["parallel"] * 3
    tree = torch.tensor([[-1, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 7, 7, 8, 8]])  # top-2, depth 4, 16 nodes
    with topology_hint(TopologyHint.from_parents(tree)):
        assert choose_route(16) == "parallel"


def test_overrides(monkeypatch):
    with use_route("hybrid"):
        assert choose_route(4) == "hybrid"
    monkeypatch.setenv("SPECLA_VERIFY_ROUTE", "parallel")
    assert choose_route(4) == "parallel"
    with use_route("serial"):  # the context wins over the environment
        assert choose_route(4) == "serial"
    monkeypatch.setenv("SPECLA_VERIFY_ROUTE", "nope")
    with pytest.raises(ValueError, match="SPECLA_VERIFY_ROUTE"):
        choose_route(4)
    with pytest.raises(ValueError, match="unknown route"), use_route("nope"):
        pass


def test_parallel_levels_follow_the_padded_size():
    levels = [dispatch.route_features("parallel", TopologyHint(n, n, 0, 1))[1] for n in (1, 16, 17, 32, 33, 64)]
    assert levels == [4, 4, 5, 5, 6, 6]  # log2 of the power-of-two node bucket (at least 16)


def test_commits_before_wait_names_states_by_address():
    """Only launches on the named states (a view of one lies where it does) may commit before their PDL wait; a copy
    of one lies elsewhere and waits first, and nothing does outside the block."""
    state = torch.randn(2, 4, 8, 8)
    with dispatch.commits_before_wait([state]):
        assert dispatch.early_commit(state) and dispatch.early_commit(state.transpose(-1, -2))
        assert not dispatch.early_commit(state.clone())
    assert not dispatch.early_commit(state)
