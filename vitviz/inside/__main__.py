"""`python -m vitviz.inside --report`: the figures of docs/inside.md."""

from vitviz.inside.report import main

main()
