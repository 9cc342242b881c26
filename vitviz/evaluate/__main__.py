"""`python -m vitviz.evaluate` (and `torchrun ... -m vitviz.evaluate`)."""

from vitviz.evaluate.cli import main

main()
