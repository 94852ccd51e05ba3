"""``python -m specla_compile``: the ``specla-generate`` command line."""

from .cli import main

if __name__ == "__main__":
    main(prog="python -m specla_compile")
