"""Operator commands: `ds-rlhf doctor`, `memory`, `report`, `autotune`, `bench`. The leaf of the package: nothing in
the library imports them (`entrypoints/main.py` names them as module paths); none loads model weights."""
