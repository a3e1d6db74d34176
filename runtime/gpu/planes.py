"""Outputs a split GEMM left as fp32 planes (TileLang's decode_planes.py: planes of 16 rows; swapped.py: of
PLANE_STRIDE rows), their sum deferred: a launch that reads such an output through a PLANES parameter gets the
planes and adds them itself (the norm launch after o_proj and down), where it reads planes of that stride; any other
launch reading its memory gets it summed first (the deferred sum launch runs then). A
pending output whose memory a kernel writes is dead (the memory plan reuses only dead buffers) and is dropped;
planes a GEMM is about to overwrite get their pending sum run before it; a collective's input is summed before
NCCL reads it. Pure Python, tested on the CPU; the
executor runs what `schedule` and `flush` return, in order."""

from collections.abc import Sequence
from dataclasses import dataclass
from math import prod

from pegainfer.backends.manifest import Launch
from pegainfer.backends.spec import ParamKind, plane_stride
from pegainfer.errors import PegainferError
from pegainfer.ir.dtypes import dtype_from_name
from pegainfer.runtime.gpu.abi import DeviceTensor

F32 = dtype_from_name("f32")
Run = tuple[str, Launch, dict[str, DeviceTensor], dict[str, int]]  # (origin, launch, env, sizes) to run


@dataclass(frozen=True, eq=False)  # by identity
class Pending:
    output: DeviceTensor  # not written yet
    planes: DeviceTensor  # the SPLIT planes the GEMM wrote, PLANE_STRIDE rows each
    launch: Launch  # the deferred sum, which writes `output`
    env: dict[str, DeviceTensor]
    sizes: dict[str, int]
    origin: str = ""  # the kernel kind / variant that deferred it, for profiles

    @property
    def stride(self) -> int:
        return plane_stride(self.launch.constexprs)

    def run(self) -> Run:
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
    """What a PLANES parameter gets where its value is stored whole: no rows (the kernel reads the value)."""
    return DeviceTensor.contiguous(0, (0, value.shape[-1]), F32)


def writes_planes(launch: Launch) -> bool:
    """A split GEMM's launch (its PLANES parameter is its own scratch, which it writes); any other launch naming
    planes reads those of its input."""
    return bool(launch.constexprs.get("PARTIAL"))


_PLANES_READERS: dict[int, tuple[Launch, bool]] = {}


def _reads_planes(launch: Launch) -> bool:
    """Whether any parameter of the launch is a PLANES one, remembered per launch (asked for every launch)."""
    entry = _PLANES_READERS.get(id(launch))
    if entry is None or entry[0] is not launch:
        entry = _PLANES_READERS[id(launch)] = (launch, any(p.kind is ParamKind.PLANES for p in launch.params))
    return entry[1]


class DeferredSums:
    def __init__(self) -> None:
        self.pending: list[Pending] = []

    def schedule(self, launches: Sequence[Launch], env: dict[str, DeviceTensor], sizes: dict[str, int],
                 origin: str = "") -> list[Run]:
        """A kernel variant's launches as the executor runs them, in order, each (origin, launch, env, sizes):
        pending sums they need first, then each launch with its planes bound; a deferred one recorded instead."""
        runs = []
        for launch in launches:
            if launch.deferred:
                self.defer(launch, env, sizes, origin)
                continue
            bound, first = self.bind(launch, env)
            runs += [p.run() for p in first] + [(origin, launch, bound, sizes)]
        return runs

    def defer(self, launch: Launch, env: dict[str, DeviceTensor], sizes: dict[str, int], origin: str = "") -> None:
        """Records a deferred sum launch instead of running it (its GEMM, bound before it, has run the sums whose
        planes it overwrote)."""
        (planes,) = [p.buffer for p in launch.params if p.kind is ParamKind.PLANES]
        (output,) = [p.buffer for p in launch.params if p.kind in (ParamKind.TENSOR, ParamKind.TMA)]
        assert not any(overlaps(p.planes, env[planes]) for p in self.pending), "planes overwritten while pending"
        scratch = env[planes]  # sized for the kernel's largest split: a reader adds only this GEMM's planes
        rows = launch.constexprs["SPLIT"] * plane_stride(launch.constexprs)
        written = DeviceTensor.contiguous(scratch.ptr, (rows, scratch.shape[-1]), scratch.dtype)
        assert written.shape[0] <= scratch.shape[0], f"{launch.symbol}: {written.shape[0]} plane rows in {scratch}"
        self.pending.append(Pending(env[output], written, launch, dict(env), dict(sizes), origin))

    def bind(self, launch: Launch, env: dict[str, DeviceTensor]) -> tuple[dict[str, DeviceTensor], list[Pending]]:
        """(the launch's env with the planes of its inputs bound, the pending sums to run before it: those of
        memory it reads other than through planes, and those whose planes it writes)."""
        if not self.pending and not _reads_planes(launch):
            return env, []
        bound, added, run = dict(env), set(), []
        for param in (p for p in launch.params if p.kind is ParamKind.PLANES):
            if writes_planes(launch):
                if param.buffer not in env:
                    raise PegainferError(f"{launch.symbol}: no scratch for its {param.buffer}")
                run += [p for p in self.pending if overlaps(p.planes, env[param.buffer]) and p not in run]
                continue
            stored = env[param.value]
            match = next((p for p in self.pending if p.output.ptr == stored.ptr and p.output.shape == stored.shape),
                         None)
            if match and (match.stride != plane_stride(launch.constexprs)
                          or match.planes.shape[0] > match.stride * launch.constexprs.get("PLANES", 0)):
                match = None  # the launch adds planes of another stride, or fewer than the GEMM left: it reads the sum
            bound[param.buffer] = match.planes if match else no_planes(stored)
            if match:
                added.add(param.value)
        for param in launch.params:
            if param.kind in (ParamKind.TENSOR, ParamKind.TMA) and param.value not in added:
                run += [p for p in self.pending if overlaps(p.output, env[param.value]) and p not in run]
        self._drop(run)
        return bound, run

    def before_reading(self, tensors: list[DeviceTensor]) -> list[Run]:
        """Something other than a launch (an NCCL collective) reads these: the pending sums of their memory, to
        run first."""
        runs = [p for p in self.pending if any(overlaps(p.output, t) for t in tensors)]
        self._drop(runs)
        return [p.run() for p in runs]

    def written(self, tensors: list[DeviceTensor]) -> None:
        """A kernel writes these: pending outputs in their memory are dead."""
        self._drop([p for p in self.pending if any(overlaps(p.output, t) for t in tensors)])

    def flush(self, needed: list[DeviceTensor]) -> list[Run]:
        """A step's end: the sums of the outputs it returns, to run; the rest dropped, as the step's buffers die."""
        runs = [p.run() for p in self.pending if any(overlaps(p.output, t) for t in needed)]
        self.pending = []
        return runs

    def _drop(self, done: list[Pending]) -> None:
        self.pending = [p for p in self.pending if p not in done]
