"""Observation on a worker host: the telemetry sampler, socket statistics, packet capture."""
