"""Benchmarks for rollout-ledger (issue #5): ingest, storage, build and proxy costs.

Run ``python -m bench run`` (full) or ``python -m bench run --quick`` (smoke); see
``bench/__main__.py``.  Against the released NeMo Gym store: ``python -m bench.gymcmp`` (the
issue-12 targets; ``python -m bench.gymreport`` renders its page again).  The proxy alone:
``python -m bench.proxy`` (overhead, side by side with a bare pass-through) and ``python -m
bench.proxy --load N`` (N concurrent rollouts through one proxy).  Performance is measured
here, never asserted in tests.
"""
