"""Alembic environment of the billing ledger.

``Ledger.migrate()`` passes its open connection in ``config.attributes["connection"]``; the ``alembic`` command
line can be used too (``-x url=...`` or ``sqlalchemy.url``). The version table is
``gpumeter_billing_alembic_version`` so the ledger can share a database with other schemas.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine, pool

from services.billing.ledger import VERSION_TABLE, metadata, normalize_url

config = context.config


def _configure(**kwargs) -> None:
    context.configure(target_metadata=metadata, version_table=VERSION_TABLE, compare_type=True, **kwargs)


def run_migrations_offline() -> None:
    url = context.get_x_argument(as_dictionary=True).get("url") or config.get_main_option("sqlalchemy.url")
    _configure(url=normalize_url(url), literal_binds=True, dialect_opts={"paramstyle": "named"})
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure(connection=connection)
        with context.begin_transaction():
            context.run_migrations()
        return
    url = context.get_x_argument(as_dictionary=True).get("url") or config.get_main_option("sqlalchemy.url")
    engine = create_engine(normalize_url(url), poolclass=pool.NullPool)
    with engine.connect() as connection:
        _configure(connection=connection)
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
