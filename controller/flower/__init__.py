"""Flower apps over the emulated network: ``flwr_run.py``'s structure file, the Flower
processes each node runs, Flower's per-round metrics, and the flow that runs them."""
