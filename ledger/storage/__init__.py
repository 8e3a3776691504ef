"""The ledger's storage layer, one room per concern (docs/architecture.md has the map).

``ledger`` joins the rooms into ``Ledger``: ``core`` (engine, transactions, the rollout lock)
under ``capture``, ``lineage``, ``snapshot`` and ``lifecycle``; ``writer`` is SQLite's group
commit, ``translate`` turns driver errors into ``ledger.errors`` by constraint name, ``results``
holds the result types, ``audit`` the read-only audit queries.  The ingest hot path is plain,
prepared SQL: ``statements`` names every statement of the write path once, in both dialects;
``ingest`` holds the intent and record logic as step functions that a SQLite driver (in the
group-commit writer thread) and an asyncpg driver (one transaction per write) run alike; ``tips``
keeps the digest state of each rollout's latest calls so a continuation hashes only its new
tokens.  SQLAlchemy stays for the schema, migrations, the read side and the rarer writes.
"""
