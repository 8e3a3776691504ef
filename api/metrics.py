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
        # Prefix supply (issue 11), the seed's counters: every captured call while it is on
        # (total), those with a proven parent (eligible), those whose proof held (supplied);
        # calls sent unchanged are counted by why.
        self.prefix_total = Counter(
            "rollout_ledger_prefix_supply_calls_total",
            "Captured calls while prefix supply is on.",
            registry=r,
        )
        self.prefix_eligible = Counter(
            "rollout_ledger_prefix_supply_eligible_total",
            "Calls whose parent was resolved and verified (a prefix was required).",
            registry=r,
        )
        self.prefix_supplied = Counter(
            "rollout_ledger_prefix_supply_supplied_total",
            "Calls whose generation-time prompt ids proved the required prefix.",
            registry=r,
        )
        self.prefix_skipped = Counter(
            "rollout_ledger_prefix_supply_unchanged_total",
            "Calls sent unchanged, by reason (root, unresolved, ...).",
            ["reason"],
            registry=r,
        )
        self.upstream_retries = Counter(
            "rollout_ledger_upstream_retries_total",
            "Upstream attempts the proxy retried (connection refused).",
            registry=r,
        )
        self.failed_attempts = Counter(
            "rollout_ledger_upstream_failed_attempts_total",
            "Upstream attempts that failed before any output (kept open for a retry).",
            registry=r,
        )
        self.retried_attempts = Counter(
            "rollout_ledger_upstream_retried_attempts_total",
            "Failed attempts cancelled because a retry of the same request succeeded.",
            registry=r,
        )
