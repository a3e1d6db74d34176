"""The CuTe DSL backend: decode GEMVs and a GEMM written in NVIDIA's CuTe DSL, compiled with cute.compile on fake
tensors to a cubin per SM."""
