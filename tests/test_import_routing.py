"""``import specla_compile`` is light, and routes the GDN entry points of modules imported before or after it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from specla_compile.import_routing import ROUTED_MODULES
from specla_compile.lowering.capture import KNOWN_ENTRY_POINTS

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import transformers.models.qwen3_5.modeling_qwen3_5 as qwen  # imported before the package
import specla_compile
assert hasattr(qwen.torch_chunk_gated_delta_rule, "__specla_original__")
import fla.layers.gated_deltanet as layer  # imported after the package
from fla.modules import ShortConvolution
assert hasattr(layer.chunk_gated_delta_rule, "__specla_original__")
assert hasattr(ShortConvolution.forward, "__specla_original__")
print("ok")
"""

LIGHT = ("import sys, specla_compile, specla_compile.cli; specla_compile.cli.build_parser().parse_args([]); "
         "print(sorted({'torch', 'fla', 'triton', 'transformers'} & set(sys.modules)))")


def _python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout, not an installed copy
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300, check=False)


def test_the_package_and_its_command_line_parser_load_no_heavy_module():
    result = _python(LIGHT)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stderr[-2000:]


def test_modules_imported_before_or_after_the_package_are_routed():
    result = _python(SCRIPT)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_every_public_name_loads():
    import specla_compile

    assert all(isinstance(getattr(specla_compile, name), type) for name in specla_compile.__all__)


def test_every_entry_point_lives_in_a_watched_module():
    assert {entry.owner.partition(":")[0] for entry in KNOWN_ENTRY_POINTS} == ROUTED_MODULES
