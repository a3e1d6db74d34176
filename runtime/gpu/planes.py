"""Outputs a split GEMM left as fp32 planes (decode_gemm.py's PARTIAL), their sum deferred: a launch that reads
such an output through a `planes:<value>` parameter gets the planes and adds them itself (the norm launch after
o_proj and down); any other launch reading its memory gets it summed first (the deferred `sum_planes` launch runs
then). A pending output whose memory a kernel writes is dead (the memory plan reuses only dead buffers) and is
dropped; planes a GEMM is about to overwrite get their pending sum run before it. Pure Python, tested on the CPU;
the executor runs what `schedule` and `flush` return, in order."""

from dataclasses import dataclass
from math import prod

from pegainfer.backends.spec import PLANE_ROWS, PLANES
from pegainfer.errors import PegainferError
from pegainfer.ir.dtypes import dtype_from_name
from pegainfer.runtime.gpu.abi import DeviceTensor

F32 = dtype_from_name("f32")


@dataclass(frozen=True, eq=False)  # by identity
class Pending:
    output: DeviceTensor  # not written yet
    planes: DeviceTensor
    launch: dict  # the deferred sum, which writes `output`
    env: dict[str, DeviceTensor]
    sizes: dict[str, int]
    origin: str = ""  # the kernel kind / variant that deferred it, for profiles

    def run(self) -> tuple[str, dict, dict[str, DeviceTensor], dict[str, int]]:
        return self.origin, self.launch, self.env, self.sizes


def span(t: DeviceTensor) -> tuple[int, int]:
    """The bytes a tensor view may touch: its first row's start to its last row's end."""
    if not t.shape or t.shape[0] == 0:
        return t.ptr, t.ptr
    last_row = (t.shape[0] - 1) * t.row_stride + prod(t.shape[1:])
    return t.ptr, t.ptr + last_row * t.dtype.itemsize


def overlaps(a: DeviceTensor, b: DeviceTensor) -> bool:
    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def no_planes(value: DeviceTensor) -> DeviceTensor:
    """What a `planes:` parameter gets where its value is stored whole: no rows (the kernel reads the value)."""
    return DeviceTensor.contiguous(0, (0, value.shape[-1]), F32)


def writes_planes(launch: dict) -> bool:
    """A split GEMM's launch (its `planes:` parameter is its own scratch, which it writes); any other launch naming
    planes reads those of its input."""
    return bool(launch.get("constexprs", {}).get("PARTIAL"))


class DeferredSums:
    def __init__(self) -> None:
        self.pending: list[Pending] = []

    def schedule(self, launches: list[dict], env: dict[str, DeviceTensor], sizes: dict[str, int],
                 origin: str = "") -> list[tuple[str, dict, dict[str, DeviceTensor], dict[str, int]]]:
        """A kernel variant's launches as the executor runs them, in order, each (origin, launch, env, sizes):
        pending sums they need first, then each launch with its planes bound; a deferred one recorded instead."""
        runs = []
        for launch in launches:
            if launch.get("deferred"):
                self.defer(launch, env, sizes, origin)
                continue
            bound, first = self.bind(launch, env)
            runs += [p.run() for p in first] + [(origin, launch, bound, sizes)]
        return runs

    def defer(self, launch: dict, env: dict[str, DeviceTensor], sizes: dict[str, int], origin: str = "") -> None:
        """Records a deferred sum launch instead of running it (its GEMM, bound before it, has run the sums whose
        planes it overwrote)."""
        tensors = [p["value"] for p in launch["params"] if p["kind"] in ("tensor", "tma")]
        (planes,) = [v for v in tensors if v.startswith(PLANES)]
        (output,) = [v for v in tensors if not v.startswith(PLANES)]
        assert not any(overlaps(p.planes, env[planes]) for p in self.pending), "planes overwritten while pending"
        self.pending.append(Pending(env[output], env[planes], launch, dict(env), dict(sizes), origin))

    def bind(self, launch: dict, env: dict[str, DeviceTensor]) -> tuple[dict[str, DeviceTensor], list[Pending]]:
        """(the launch's env with the planes of its inputs bound, the pending sums to run before it: those of
        memory it reads other than through planes, and those whose planes it writes)."""
        bound, added, run = dict(env), set(), []
        for param in launch["params"]:
            value = param["value"]
            if param["kind"] != "tensor" or not value.startswith(PLANES):
                continue
            if writes_planes(launch):
                if value not in env:
                    raise PegainferError(f"{launch.get('symbol', launch.get('key'))}: no scratch for its {value}")
                run += [p for p in self.pending if overlaps(p.planes, env[value]) and p not in run]
                continue
            stored = env[value[len(PLANES):]]
            match = next((p for p in self.pending if p.output.ptr == stored.ptr and p.output.shape == stored.shape),
                         None)
            if match and match.planes.shape[0] > PLANE_ROWS * launch.get("constexprs", {}).get("PLANES", 0):
                match = None  # the launch adds fewer planes than the GEMM left: it reads the value summed instead
            bound[value] = match.planes if match else no_planes(stored)
            if match:
                added.add(value[len(PLANES):])
        for param in launch["params"]:
            value = param["value"]
            if param["kind"] in ("tensor", "tma") and not value.startswith(PLANES) and value not in added:
                run += [p for p in self.pending if overlaps(p.output, env[value]) and p not in run]
        self._drop(run)
        return bound, run

    def written(self, tensors: list[DeviceTensor]) -> None:
        """A kernel writes these: pending outputs in their memory are dead."""
        self._drop([p for p in self.pending if any(overlaps(p.output, t) for t in tensors)])

    def flush(self, needed: list[DeviceTensor]) -> list[tuple[str, dict, dict[str, DeviceTensor], dict[str, int]]]:
        """A step's end: the sums of the outputs it returns, to run; the rest dropped, as the step's buffers die."""
        runs = [p.run() for p in self.pending if any(overlaps(p.output, t) for t in needed)]
        self.pending = []
        return runs

    def _drop(self, done: list[Pending]) -> None:
        self.pending = [p for p in self.pending if p not in done]
