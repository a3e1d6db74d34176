"""Frontends: config.json + a DAG file -> an IR graph, and a checkpoint folder -> weights bound by name."""
