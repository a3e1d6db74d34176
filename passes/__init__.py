"""Graph-to-graph passes (fusion, weight transforms, memory planning): the pass pipeline of issue 3."""
