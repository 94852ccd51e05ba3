import math

import numpy as np
import pytest

from specla_compile.runtime.config import SpecConfig


@pytest.mark.parametrize(
    "field, value",
    [
        ("mode", "beam"),
        ("depth", 0),
        ("tree_top_k", 0),
        ("budget", -1),
        ("bucket", 0),
        ("tau", -1.0),
        ("tau", math.nan),
        ("engine", "graphs"),
        ("prefill", "fast"),
    ],
)
def test_out_of_range_values_raise_value_error(field, value):
    with pytest.raises(ValueError, match=field):
        SpecConfig(**{field: value})


@pytest.mark.parametrize(
    "field, value",
    [
        ("depth", 4.5),
        ("depth", 4.0),
        ("depth", "4"),
        ("depth", True),
        ("tree_top_k", None),
        ("budget", False),
        ("bucket", 8.0),
        ("tau", "1"),
        ("tau", True),
        ("cuda_graphs", "yes"),
        ("pipelined", "on"),
    ],
)
def test_wrong_types_raise_type_error(field, value):
    with pytest.raises(TypeError, match=field):
        SpecConfig(**{field: value})


def test_integer_like_values_become_plain_numbers():
    config = SpecConfig(depth=np.int64(3), tau=2)
    assert type(config.depth) is int and config.depth == 3
    assert type(config.tau) is float and config.tau == 2.0
    assert SpecConfig(tau=math.inf).tau == math.inf


def test_top_k_was_renamed_without_alias():
    assert SpecConfig(tree_top_k=3).tree_top_k == 3
    with pytest.raises(TypeError):
        SpecConfig(top_k=3)


def test_max_nodes():
    assert SpecConfig(mode="chain", depth=5).max_nodes == 6
    assert SpecConfig(mode="tree", budget=12).max_nodes == 13


def test_passes_pad_drafts_to_the_bucket_and_by_default_not_at_large_batches():
    from specla_compile.runtime.config import BATCH_WITHOUT_PADDING

    chain, tree = SpecConfig(depth=8), SpecConfig(mode="tree", budget=16)
    assert chain.bucket is None
    assert [chain.pass_nodes(b) for b in (1, BATCH_WITHOUT_PADDING - 1)] == [16, 16]  # 9 nodes in multiples of 8
    assert [chain.pass_nodes(b) for b in (BATCH_WITHOUT_PADDING, 16)] == [9, 9]  # the draft's own size
    assert [tree.pass_nodes(b) for b in (1, 16)] == [24, 17]
    assert SpecConfig(depth=8, bucket=16).pass_nodes(16) == 16  # a bucket the caller set holds at every batch
    assert SpecConfig(depth=3, bucket=1).pass_nodes(1) == 4
