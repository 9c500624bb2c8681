"""Text, JSON and CSV views of the planner's records. Nothing is computed here."""
