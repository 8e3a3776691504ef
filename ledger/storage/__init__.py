"""The ledger's ingest hot path in plain, prepared SQL (issue 12).

``statements`` names every statement of the write path once, in both dialects; ``ingest`` holds
the intent and record logic as step functions that a SQLite driver (in the group-commit writer
thread) and an asyncpg driver (one transaction per write) run alike; ``tips`` keeps the digest
state of each rollout's latest calls so a continuation hashes only its new tokens.
SQLAlchemy stays for the schema, migrations, the read side and the rarer writes.
"""
