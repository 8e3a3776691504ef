"""Drop ``ix_lineage_edges_child_id``: ``uq_lineage_edges_child_id_parent_id`` leads with
``child_id``, so it already serves every lookup and cascading delete by child, and the second
index only cost space and a write per edge.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("lineage_edges") as batch_op:
        batch_op.drop_index(batch_op.f("ix_lineage_edges_child_id"))


def downgrade() -> None:
    with op.batch_alter_table("lineage_edges") as batch_op:
        batch_op.create_index(batch_op.f("ix_lineage_edges_child_id"), ["child_id"])
