"""Index the foreign keys that cascading deletes follow.

Postgres does not index referencing columns by itself: without these, retiring or deleting a
rollout scans ``lineage_edges`` and ``quarantines`` once per deleted call.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("lineage_edges") as batch_op:
        batch_op.create_index(batch_op.f("ix_lineage_edges_child_id"), ["child_id"])
        batch_op.create_index(batch_op.f("ix_lineage_edges_parent_id"), ["parent_id"])
    with op.batch_alter_table("quarantines") as batch_op:
        batch_op.create_index(batch_op.f("ix_quarantines_delivery_id"), ["delivery_id"])


def downgrade() -> None:
    with op.batch_alter_table("quarantines") as batch_op:
        batch_op.drop_index(batch_op.f("ix_quarantines_delivery_id"))
    with op.batch_alter_table("lineage_edges") as batch_op:
        batch_op.drop_index(batch_op.f("ix_lineage_edges_parent_id"))
        batch_op.drop_index(batch_op.f("ix_lineage_edges_child_id"))
