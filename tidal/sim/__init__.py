"""``tidal simulate``: a discrete-event simulator of the controller (see docs/simulate.md)."""
