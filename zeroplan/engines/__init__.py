"""One module per training engine: reading its configuration and emitting it for a planned option."""
