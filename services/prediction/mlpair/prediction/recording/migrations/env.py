"""Alembic environment for PredictionService's two databases (run through ``crm.migrate``).

The revisions live in two branches: ``crm`` (the CRM database) and ``ledger`` (the decision
ledger); each database is upgraded to its own branch head and keeps its own ``alembic_version``
table (the ledger's in its ``prediction`` schema on PostgreSQL).
:func:`mlpair.prediction.recording.migrate.upgrade` passes an open connection in
``config.attributes["connection"]``; there is no ``alembic.ini``.
"""

from alembic import context

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError("run migrations through mlpair.prediction.recording.migrate, which supplies the connection")

context.configure(
    connection=connection,
    target_metadata=context.config.attributes.get("target_metadata"),
    version_table_schema=context.config.attributes.get("version_table_schema"),
    render_as_batch=True,
)
with context.begin_transaction():
    context.run_migrations()
