"""Ahead-of-time compilation of one planned launch to PTX and a cubin for one SM, with no GPU present."""

from dataclasses import dataclass

from pegainfer.backends.spec import LaunchSpec
from pegainfer.backends.triton.loader import load_kernel_module, triton_interpret


@dataclass
class CompiledLaunch:
    function: str  # the kernel's symbol in the cubin
    cubin: bytes
    ptx: str
    shared: int  # bytes of dynamic shared memory the launch needs
    num_warps: int
    scratch: dict[str, int]  # Triton's trailing pointer parameters: global and profile scratch, size and alignment
    triton_version: str
    pdl: bool  # launch with programmatic stream serialization: the kernel waits for its predecessor itself


def pdl_supported(sm: int) -> bool:
    """griddepcontrol (programmatic dependent launch) exists from sm_90 on."""
    return sm >= 90


def triton_version() -> str:
    """Read from the package metadata: importing triton would fix this process's compile-or-interpret mode."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("triton")
    except PackageNotFoundError:
        raise ImportError("triton is not installed", name="triton") from None


def compile_launch(launch: LaunchSpec, sm: int) -> CompiledLaunch:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    with triton_interpret(False):
        module = load_kernel_module(launch.source, launch.module, interpret=False)
        function = getattr(module, launch.function)
        types = {p.name: p.dtype for p in launch.params}
        constexprs = dict(launch.constexprs)
        pdl = "PDL" in function.arg_names and pdl_supported(sm)  # a kernel opts in by taking a PDL constexpr
        if "PDL" in function.arg_names:
            constexprs["PDL"] = pdl
        missing = [a for a in function.arg_names if a not in types and a not in constexprs]
        assert not missing, f"{launch.function}: arguments {missing} are neither parameters nor constexprs"
        signature = {a: types.get(a, "constexpr") for a in function.arg_names}
        aligned = {p.name for p in launch.params if p.aligned}
        attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(function.arg_names) if a in aligned}
        source = ASTSource(function, signature=signature, constexprs=constexprs, attrs=attrs)
        compiled = triton.compile(source, target=GPUTarget("cuda", sm, 32),
                                  options={"num_warps": launch.num_warps, "num_stages": launch.num_stages})
    meta = compiled.metadata
    scratch = {"global_scratch_size": meta.global_scratch_size, "global_scratch_align": meta.global_scratch_align,
               "profile_scratch_size": meta.profile_scratch_size, "profile_scratch_align": meta.profile_scratch_align}
    return CompiledLaunch(meta.name, compiled.asm["cubin"], compiled.asm["ptx"], meta.shared, meta.num_warps,
                          scratch, triton.__version__, pdl)
