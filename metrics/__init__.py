"""Prometheus metrics of the sidecar."""
