"""DAG files, one per architecture family, and the embedded config.json of common sizes (configs/)."""
