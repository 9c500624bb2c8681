import os

# Plots are rendered without a display, in tests and in executed notebooks.
os.environ.setdefault("MPLBACKEND", "agg")
