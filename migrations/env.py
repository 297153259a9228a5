"""Alembic environment: batch mode for SQLite, the models' naming convention."""
from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine

from statesvc.models import Base

config = context.config
target_metadata = Base.metadata


def run_migrations_offline() -> None:
    context.configure(url=config.get_main_option("sqlalchemy.url"),
                      target_metadata=target_metadata, render_as_batch=True,
                      literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is None:
        engine = create_engine(config.get_main_option("sqlalchemy.url") or "")
        with engine.connect() as conn:
            _run(conn)
        engine.dispose()
    else:
        _run(connection)


def _run(connection: object) -> None:
    context.configure(connection=connection, target_metadata=target_metadata,
                      render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
