"""Outputs a split GEMM left as fp32 planes (decode_gemm.py's PARTIAL), their sum deferred: a launch that reads
such an output through a `planes:<value>` parameter gets the planes and adds them itself (the norm launch after
o_proj and down); any other launch reading its memory gets it summed first (the deferred `sum_planes` launch runs
then). A pending output whose memory a kernel writes is dead (the memory plan reuses only dead buffers) and
is dropped. Pure Python, tested on the CPU; the executor launches what `bind` and `defer` return."""

from collections.abc import Callable
from dataclasses import dataclass

from pegainfer.ir.dtypes import dtype_from_name
from pegainfer.runtime.gpu.abi import DeviceTensor

PLANES = "planes:"  # a parameter value naming the planes of a graph value (backends/tilelang/plan.planes_of)
PLANE_ROWS = 16  # rows a plane holds (backends/tilelang/kernels/rows.py)
F32 = dtype_from_name("f32")


@dataclass(frozen=True, eq=False)  # by identity
class Pending:
    output: DeviceTensor  # not written yet
    planes: DeviceTensor
    launch: dict  # the deferred sum, which writes `output`
    env: dict[str, DeviceTensor]
    sizes: dict[str, int]
    origin: str = ""  # the kernel kind / variant that deferred it, for profiles


def span(t: DeviceTensor) -> tuple[int, int]:
    """The bytes a tensor view may touch: its first row's start to its last row's end."""
    if not t.shape or t.shape[0] == 0:
        return t.ptr, t.ptr
    inner = t.row_stride if len(t.shape) > 1 else 1
    last_row = (t.shape[0] - 1) * inner + (t.shape[-1] if len(t.shape) > 1 else 1)
    return t.ptr, t.ptr + last_row * t.dtype.itemsize


def overlaps(a: DeviceTensor, b: DeviceTensor) -> bool:
    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def no_planes(value: DeviceTensor) -> DeviceTensor:
    """What a `planes:` parameter gets where its value is stored whole: no rows (the kernel reads the value)."""
    return DeviceTensor.contiguous(0, (0, value.shape[-1]), F32)


class DeferredSums:
    def __init__(self) -> None:
        self.pending: list[Pending] = []

    def defer(self, launch: dict, env: dict[str, DeviceTensor], sizes: dict[str, int],
              origin: str = "") -> list[Pending]:
        """Records a deferred sum launch instead of running it; returns the pending sums to run first: those whose
        planes these overwrite (still live as far as we know)."""
        tensors = [p["value"] for p in launch["params"] if p["kind"] in ("tensor", "tma")]
        (planes,) = [v for v in tensors if v.startswith(PLANES)]
        (output,) = [v for v in tensors if not v.startswith(PLANES)]
        first = [p for p in self.pending if overlaps(p.planes, env[planes])]
        self._drop(first)
        self.pending.append(Pending(env[output], env[planes], launch, dict(env), dict(sizes), origin))
        return first

    def bind(self, launch: dict, env: dict[str, DeviceTensor]) -> tuple[dict[str, DeviceTensor], list[Pending]]:
        """(the launch's env with its `planes:` values bound, the pending sums to run before it: those of memory
        it reads other than through planes)."""
        bound, added = dict(env), set()
        for param in launch["params"]:
            value = param["value"]
            if param["kind"] == "tensor" and value.startswith(PLANES) and value not in env:  # else the GEMM's own
                stored = env[value[len(PLANES):]]
                match = next((p for p in self.pending if p.output.ptr == stored.ptr
                              and p.output.shape == stored.shape), None)
                if match and match.planes.shape[0] > PLANE_ROWS * launch.get("constexprs", {}).get("PLANES", 0):
                    # the launch adds fewer planes than the GEMM left: it reads the value summed instead
                    match = None
                bound[value] = match.planes if match else no_planes(stored)
                if match:
                    added.add(value[len(PLANES):])
        run = []
        for param in launch["params"]:
            value = param["value"]
            if param["kind"] not in ("tensor", "tma") or value in added or (value.startswith(PLANES)
                                                                            and value not in env):
                continue
            run += [p for p in self.pending if overlaps(p.output, env[value]) and p not in run]
        self._drop(run)
        return bound, run

    def written(self, tensors: list[DeviceTensor]) -> None:
        """A kernel writes these: pending outputs in their memory are dead."""
        self._drop([p for p in self.pending if any(overlaps(p.output, t) for t in tensors)])

    def flush(self, needed: list[DeviceTensor], run: Callable[[Pending], None]) -> None:
        """A step's end: sums whose outputs it returns run; the rest are dropped, as the step's buffers die."""
        for p in [p for p in self.pending if any(overlaps(p.output, t) for t in needed)]:
            run(p)
        self.pending = []

    def _drop(self, done: list[Pending]) -> None:
        self.pending = [p for p in self.pending if p not in done]
