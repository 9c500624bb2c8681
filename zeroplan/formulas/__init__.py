"""Pure math: numbers in, frozen typed records out; no I/O, torch, pandas or matplotlib. Each formula's
docstring names its source (the ZeRO paper unless stated)."""
