"""Data curation: a chain of blocks that keep or drop rows with a reason (``tidal curate``, docs/curate.md)."""
