"""``zeroplan.estimate``: model states and communication of ZeRO stages 0-3 for one configuration."""
