"""Speculative generation with a specla-compiled GDN model, against plain decoding of the same model.

The command line lives in :mod:`specla_compile.cli` (installed as ``specla-generate``, also
``python -m specla_compile``); this script runs it from a source checkout. With no arguments it runs
offline on a small GDN trained in-process, drafted by prompt lookup.

    python examples/generate.py
    python examples/generate.py --model path/to/checkpoint --prompt "Hello" --drafter eagle:path/to/head
    python examples/generate.py --help
"""

from specla_compile.cli import main

if __name__ == "__main__":
    main()
