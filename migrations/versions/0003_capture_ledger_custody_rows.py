"""NeMo Gym 0.7.0 ``CaptureLedger``: token-free custody rows of externally staged calls.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "custody_rows",
        sa.Column("id", BigId, autoincrement=True, nullable=False),
        sa.Column("rollout_id", sa.String(length=200), nullable=False),
        sa.Column("model_call_id", sa.String(length=200), nullable=False),
        sa.Column("failure_reason", sa.String(length=200), nullable=False),
        sa.Column("fingerprint", sa.String(length=64), nullable=True),
        sa.Column("fingerprint_version", sa.Integer(), nullable=True),
        sa.Column("context_len", sa.Integer(), nullable=False),
        sa.Column("context_digest", sa.String(length=64), nullable=True),
        sa.Column("row", sa.JSON(), nullable=False),
        sa.Column("row_digest", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["rollout_id"],
            ["rollouts.rollout_id"],
            name=op.f("fk_custody_rows_rollout_id_rollouts"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_custody_rows")),
        sa.UniqueConstraint(
            "rollout_id",
            "model_call_id",
            "failure_reason",
            name=op.f("uq_custody_rows_rollout_id_model_call_id_failure_reason"),
        ),
    )
    with op.batch_alter_table("custody_rows") as batch_op:
        batch_op.create_index(
            batch_op.f("ix_custody_rows_rollout_id_fingerprint"), ["rollout_id", "fingerprint"]
        )


def downgrade() -> None:
    with op.batch_alter_table("custody_rows") as batch_op:
        batch_op.drop_index(batch_op.f("ix_custody_rows_rollout_id_fingerprint"))
    op.drop_table("custody_rows")
