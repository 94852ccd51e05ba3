"""Programmatic dependent launch: where specla's kernels and inductor's turn it on (``kernels/pdl.py``)."""

from __future__ import annotations

import pytest
import torch

from specla_compile.kernels import pdl


def test_no_pdl_off_cuda():
    assert not pdl.enabled(torch.device("cpu"))
    assert pdl.launch_args(torch.device("cpu")) == {"USE_PDL": False}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_pdl_follows_the_compute_capability():
    hopper = torch.cuda.get_device_capability()[0] >= 9
    assert pdl.enabled(torch.device("cuda")) == hopper
    assert pdl.launch_args(torch.device("cuda")) == ({"USE_PDL": True, "launch_pdl": True} if hopper else {"USE_PDL": False})


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs a CUDA GPU of compute capability 9.0 or newer")
def test_the_backend_turns_on_inductors_pdl():
    from torch._inductor.utils import run_and_get_code

    import specla_compile.backend  # noqa: F401  (registers the backend by name without an installed entry point)

    x = torch.randn(1000, device="cuda")
    compiled = torch.compile(lambda t: (t * 2).sin() + 1, backend="specla")
    out, code = run_and_get_code(compiled, x)
    torch.testing.assert_close(out, (x * 2).sin() + 1)
    assert any("gdc_wait" in source for source in code)
