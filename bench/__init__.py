"""Benchmarks for rollout-ledger (issue #5): ingest, storage, build and proxy costs.

Run ``python -m bench run`` (full) or ``python -m bench run --quick`` (smoke); see
``bench/__main__.py``.  Performance is measured here, never asserted in tests.
"""
