"""The Triton backend: kernel templates (kernels/), generated row kernels, planning, AOT compilation to cubins,
and an executor that runs a kernel DAG under Triton's CPU interpreter for tests."""
