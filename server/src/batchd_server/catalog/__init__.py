"""The sample catalog: schema, migrations, ingest and the split reader.

This package is the only one in batchd_server that imports SQLAlchemy.
"""
