"""The GPU path: cubins from the manifest, launched through the CUDA driver layer over device buffers."""
