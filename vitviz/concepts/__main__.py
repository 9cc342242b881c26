"""`python -m vitviz.concepts` (and `torchrun ... -m vitviz.concepts`)."""

from vitviz.concepts.cli import main

main()
