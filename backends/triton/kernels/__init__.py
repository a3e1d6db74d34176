"""Triton kernel templates, specialised per kernel node by constexprs. Never imported by the serving process."""
