"""Code generators that turn kernel DAG nodes into Triton, TileLang and CuTe DSL cubins (issues 4 and 7)."""
