"""The log, snapshots and blobs; triggers that keep the log append-only.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "events",
        sa.Column("seq", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("event_id", sa.String(36), nullable=False),
        sa.Column("type", sa.String(64), nullable=False),
        sa.Column("payload", sa.JSON(), nullable=False),
        sa.Column("recorded_at", sa.String(32), nullable=False),
        sa.Column("actor", sa.String(128), nullable=False),
        sa.PrimaryKeyConstraint("seq", name=op.f("pk_events")),
        sa.UniqueConstraint("event_id", name=op.f("uq_events_event_id")),
    )
    op.create_table(
        "snapshots",
        sa.Column("seq", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("state", sa.LargeBinary(), nullable=False),
        sa.Column("digest", sa.String(64), nullable=False),
        sa.Column("created_at", sa.String(32), nullable=False),
        sa.PrimaryKeyConstraint("seq", name=op.f("pk_snapshots")),
    )
    op.create_table(
        "blobs",
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("size", sa.Integer(), nullable=False),
        sa.Column("first_seq", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.String(32), nullable=False),
        sa.PrimaryKeyConstraint("sha256", name=op.f("pk_blobs")),
    )
    postgres = op.get_bind().dialect.name == "postgresql"
    if postgres:  # one function raising integrity_constraint_violation (IntegrityError)
        op.execute(
            "CREATE FUNCTION events_append_only() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            "RAISE EXCEPTION 'events are append-only: % is not allowed', TG_OP "
            "USING ERRCODE = 'integrity_constraint_violation'; END $$")
    for action in ("UPDATE", "DELETE"):
        if postgres:
            op.execute(f"CREATE TRIGGER events_no_{action.lower()} BEFORE {action} ON events "
                       "FOR EACH ROW EXECUTE FUNCTION events_append_only()")
        else:
            op.execute(
                f"CREATE TRIGGER events_no_{action.lower()} BEFORE {action} ON events BEGIN "
                f"SELECT RAISE(ABORT, 'events are append-only: {action} is not allowed'); END")


def downgrade() -> None:
    on = " ON events" if op.get_bind().dialect.name == "postgresql" else ""
    op.execute(f"DROP TRIGGER IF EXISTS events_no_update{on}")
    op.execute(f"DROP TRIGGER IF EXISTS events_no_delete{on}")
    if on:
        op.execute("DROP FUNCTION IF EXISTS events_append_only()")
    op.drop_table("blobs")
    op.drop_table("snapshots")
    op.drop_table("events")
