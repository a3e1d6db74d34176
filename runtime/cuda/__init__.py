"""The CUDA driver layer, on cuda.bindings alone: context, stream, memory, modules, launches, graphs."""
