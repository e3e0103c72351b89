"""``python -m torchdist.bench``: the same as the ``torchdist-bench`` console script."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
