"""python -m vitviz.dev.bench (see the package's docstring)."""

from vitviz.dev.bench.cli import main


main()
