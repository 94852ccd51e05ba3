import pytest

from specla_compile.runtime.config import SpecConfig


@pytest.mark.parametrize("field, value", [("mode", "beam"), ("depth", 0), ("top_k", 0), ("budget", 0), ("bucket", 0), ("tau", -1.0)])
def test_invalid_config(field, value):
    with pytest.raises(ValueError, match=field):
        SpecConfig(**{field: value})


def test_max_nodes():
    assert SpecConfig(mode="chain", depth=5).max_nodes == 6
    assert SpecConfig(mode="tree", budget=12).max_nodes == 13
