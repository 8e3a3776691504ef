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


# Every metric name starts with this.
PREFIX = "rollout_ledger_"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.ingest = self._counter("ingest_total", "Ledger ingest operations.", "op", "outcome")
        self.ingest_seconds = self._histogram("ingest_seconds", "Ledger ingest latency.", "op")
        self.incomplete = self._counter(
            "incomplete_marks_total", "Incomplete marks by reason.", "reason"
        )
        self.masked = self._counter("masked_rollouts_total", "Masked rollouts by reason.", "reason")
        self.builds = self._counter("builds_total", "Rollout builds by outcome.", "outcome")
        self.freezes = self._counter("freezes_total", "Freezes.")
        self.retires = self._counter("retires_total", "Retire attempts.", "result")
        self.upstream_seconds = self._histogram(
            "upstream_seconds", "Upstream model call latency.", "route"
        )
        self.upstream_errors = self._counter("upstream_errors_total", "Upstream failures.", "kind")
        self.proxy_calls = self._counter(
            "proxy_calls_total", "Proxied model calls.", "dialect", "outcome"
        )
        # Prefix supply (issue 11), the seed's counters: every captured call while it is on
        # (total), those with a proven parent (eligible), those whose proof held (supplied);
        # calls sent unchanged are counted by why.
        self.prefix_total = self._counter(
            "prefix_supply_calls_total", "Captured calls while prefix supply is on."
        )
        self.prefix_eligible = self._counter(
            "prefix_supply_eligible_total",
            "Calls whose parent was resolved and verified (a prefix was required).",
        )
        self.prefix_supplied = self._counter(
            "prefix_supply_supplied_total",
            "Calls whose generation-time prompt ids proved the required prefix.",
        )
        self.prefix_skipped = self._counter(
            "prefix_supply_unchanged_total",
            "Calls sent unchanged, by reason (root, unresolved, ...).",
            "reason",
        )
        self.upstream_retries = self._counter(
            "upstream_retries_total",
            "Upstream attempts the proxy sent again (a refused connection, or a reused "
            "connection dropped before any answer).",
        )
        self.failed_attempts = self._counter(
            "upstream_failed_attempts_total",
            "Upstream attempts that failed before any output (kept open for a retry).",
        )
        self.retried_attempts = self._counter(
            "upstream_retried_attempts_total",
            "Failed attempts cancelled because a retry of the same request succeeded.",
        )

    def _counter(self, name: str, documentation: str, *labels: str) -> Counter:
        """A counter ``rollout_ledger_<name>`` in this application's registry."""
        return Counter(f"{PREFIX}{name}", documentation, labels, registry=self.registry)

    def _histogram(self, name: str, documentation: str, *labels: str) -> Histogram:
        """A latency histogram ``rollout_ledger_<name>`` in this application's registry."""
        return Histogram(
            f"{PREFIX}{name}",
            documentation,
            labels,
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
