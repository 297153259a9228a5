"""The schema: SQLAlchemy 2 typed tables. Alembic (migrations/) is what creates them."""
from __future__ import annotations

from sqlalchemy import JSON, Integer, LargeBinary, MetaData, String
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class EventRow(Base):
    """The log. Append-only: triggers reject UPDATE and DELETE."""

    __tablename__ = "events"
    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    event_id: Mapped[str] = mapped_column(String(36), unique=True)
    type: Mapped[str] = mapped_column(String(64))
    payload: Mapped[dict[str, object]] = mapped_column(JSON)
    recorded_at: Mapped[str] = mapped_column(String(32))
    actor: Mapped[str] = mapped_column(String(128))


class SnapshotRow(Base):
    """The reduced state at a seq (canonical msgpack), so a replica need not read the whole log."""

    __tablename__ = "snapshots"
    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    state: Mapped[bytes] = mapped_column(LargeBinary)
    digest: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[str] = mapped_column(String(32))


class BlobRow(Base):
    """A content-addressed adapter weights file under <data-dir>/blobs."""

    __tablename__ = "blobs"
    sha256: Mapped[str] = mapped_column(String(64), primary_key=True)
    size: Mapped[int] = mapped_column(Integer)
    first_seq: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[str] = mapped_column(String(32))


class BlobChunkRow(Base):
    """PostgreSQL only: a blob's bytes, chunk `idx` of CHUNK_BYTES (statesvc/persistence/postgres_blobs.py)."""

    __tablename__ = "blob_chunks"
    sha256: Mapped[str] = mapped_column(String(64), primary_key=True)
    idx: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    data: Mapped[bytes] = mapped_column(LargeBinary)
