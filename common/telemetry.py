"""What the three services' Prometheus metrics share, so their latency histograms can be compared and summed."""

from __future__ import annotations

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0)
"""Histogram buckets in seconds for request latencies (TTFT, inter-token, end to end, queue, prefill, decode):
10 ms to 80 s, denser below 1 s where interactive targets lie."""
