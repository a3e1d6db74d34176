"""Code generators that turn kernel DAG nodes into Triton, TileLang and CuTe DSL cubins, and the manifest they write."""
