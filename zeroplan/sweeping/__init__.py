"""``zeroplan.sweep``: estimates over a grid of configurations, evaluated on numpy arrays (pandas out)."""
