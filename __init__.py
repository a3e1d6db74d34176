"""pegainfer: a compiler-style LLM inference system (model DAGs -> fused kernels -> cubins -> runtime)."""

__version__ = "0.1.0"
