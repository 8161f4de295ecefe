"""The run folder: its layout, what a run writes, what is derived from it."""
