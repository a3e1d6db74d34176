"""The TileLang backend: Hopper tensor-core kernels (TMA loads, wgmma) lowered to CUDA and compiled with nvcc."""
