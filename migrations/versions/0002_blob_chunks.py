"""Blob bytes in the database, in chunks: PostgreSQL only (SQLite keeps them on disk).

With PostgreSQL several statesvc instances share one log, so every instance must be able
to serve every blob: the bytes are written in the transaction of the event that names them.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.create_table(
        "blob_chunks",
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("idx", sa.Integer(), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.PrimaryKeyConstraint("sha256", "idx", name=op.f("pk_blob_chunks")),
    )
    # chunks are already compressed-looking float bytes: no TOAST compression attempts
    op.execute("ALTER TABLE blob_chunks ALTER COLUMN data SET STORAGE EXTERNAL")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.drop_table("blob_chunks")
