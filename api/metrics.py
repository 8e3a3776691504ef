"""Prometheus metrics, one registry per application (tests run many apps in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

# Incomplete reasons the service itself records; anything else a caller sends is counted as
# "other", so callers cannot create unbounded label sets (the stored event keeps the reason).
KNOWN_INCOMPLETE_REASONS = frozenset(
    {
        "capture_failed",
        "missing_token_ids",
        "malformed_token_payload",
        "conflicting_payload",
        "dangling_intent",
        "unrecognized_route",
        "upstream_error",
        "delta_chain_unreconstructable",
        "prefix_supply_failed",
    }
)


def incomplete_label(reason: str) -> str:
    return reason if reason in KNOWN_INCOMPLETE_REASONS else "other"


LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ingest = Counter(
            "rollout_ledger_ingest_total",
            "Ledger ingest operations.",
            ["op", "outcome"],
            registry=r,
        )
        self.ingest_seconds = Histogram(
            "rollout_ledger_ingest_seconds",
            "Ledger ingest latency.",
            ["op"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.incomplete = Counter(
            "rollout_ledger_incomplete_marks_total",
            "Incomplete marks by reason.",
            ["reason"],
            registry=r,
        )
        self.masked = Counter(
            "rollout_ledger_masked_rollouts_total",
            "Masked rollouts by reason.",
            ["reason"],
            registry=r,
        )
        self.builds = Counter(
            "rollout_ledger_builds_total", "Rollout builds by outcome.", ["outcome"], registry=r
        )
        self.freezes = Counter("rollout_ledger_freezes_total", "Freezes.", registry=r)
        self.retires = Counter(
            "rollout_ledger_retires_total", "Retire attempts.", ["result"], registry=r
        )
        self.upstream_seconds = Histogram(
            "rollout_ledger_upstream_seconds",
            "Upstream model call latency.",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.upstream_errors = Counter(
            "rollout_ledger_upstream_errors_total", "Upstream failures.", ["kind"], registry=r
        )
        self.proxy_calls = Counter(
            "rollout_ledger_proxy_calls_total",
            "Proxied model calls.",
            ["dialect", "outcome"],
            registry=r,
        )
