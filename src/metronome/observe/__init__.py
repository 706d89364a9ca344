"""Observability: Prometheus metrics, the silent-stall detector, the KV saturation forecast."""
