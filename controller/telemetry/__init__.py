"""Pulling the hosts' samplers into the run folder's telemetry tables."""
