"""Choosing one variant per slot of each kernel among the backends' candidates, per SM. A slot is a row bound
(and minimum step sizes): its variants are alternatives. `pegainfer tune` times them on the GPU for the model's
shapes and writes the winner per slot into the cache; without tuning data the SM's default below decides, and a
backend not compiled into the cache falls back to the next."""

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

from pegainfer.backends.cache import model_id, sm_folder
from pegainfer.backends.manifest import Kernel, Selection, Variant, dump, load
from pegainfer.backends.spec import Slotted, slot_rank
from pegainfer.ir.types import TensorType

# What won on the H200 (docs/BENCHMARKS.md): TileLang's TMA-fed tiles for prefill GEMMs and attention and for
# decode GEMMs of up to 16 rows. CuTe DSL's GEMVs won slots alone but slowed the whole step; every other SM and
# family runs Triton's.
DEFAULT_PREFERENCE: dict[int, dict[str, tuple[str, ...]]] = {
    90: {"gemm": ("tilelang", "triton"), "gemv": ("tilelang", "triton"), "attention": ("tilelang", "triton")},
}
FALLBACK = ("triton",)


class Named(Protocol):
    """A kernel as selection reads it, planned (KernelSpec) or compiled (the manifest's Kernel)."""
    graph: str
    node: str
    ops: Sequence[str]  # its fused ops, in order


S = TypeVar("S", bound=Slotted)  # a planned variant (VariantSpec) or a compiled one (the manifest's Variant)


def family(kernel: Named, slot: tuple) -> str:
    """What a slot computes, for the default table: gemv (GEMMs of at most 16 rows), gemm, attention, other."""
    if "paged_attention" in kernel.ops:
        return "attention"
    if "linear" in kernel.ops:
        return "gemv" if slot[0] is not None and slot[0] <= 16 else "gemm"
    return "other"


def slot_key(slot: tuple) -> str:
    rows = "any rows" if slot[0] is None else f"rows<={slot[0]}"
    return rows + "".join(f", {name}>={least}" for name, least in slot[1])


def tuning_path(root: Path, sm: int, spec: Any) -> Path:
    return sm_folder(root, sm) / "tuning" / f"{model_id(spec)}.json"


def read_tuning(root: Path, sm: int, spec: Any) -> dict:
    path = tuning_path(root, sm, spec)
    return json.loads(path.read_text()) if path.is_file() else {}


def slots(variants: list[S]) -> dict[tuple, list[S]]:
    """Slot -> its alternatives, slots ordered as the runtime tries them: conditional ones (minimum sizes) first,
    then by row bound, unbounded last."""
    grouped: dict[tuple, list[S]] = {}
    for variant in variants:
        grouped.setdefault(variant.slot, []).append(variant)
    order = sorted(grouped, key=slot_rank)
    return {slot: grouped[slot] for slot in order}


def choose(kernel: Named, variants: list[S], sm: int, tuning: dict) -> tuple[list[S], list[Selection]]:
    """(the chosen variants in the runtime's order, one selection per slot). A conditional slot may be left empty
    (its steps fall through to the next slot) when the chosen backend has nothing there."""
    tuned = tuning.get("kernels", {}).get(f"{kernel.graph}/{kernel.node}", {})
    chosen, selections = [], []
    for slot, alternatives in slots(variants).items():
        key = slot_key(slot)
        labels = tuple(v.label for v in alternatives)
        if key in tuned and tuned[key]["choice"] in (*labels, "fallthrough"):
            selection = Selection(key, labels, "tuned", tuned[key]["choice"], dict(tuned[key].get("times_us", {})))
        else:
            selection = Selection(key, labels, "default", default_choice(kernel, slot, alternatives, sm))
        selections.append(selection)
        chosen += [v for v in alternatives if v.label == selection.chosen]
    return chosen, selections


def default_choice(kernel: Named, slot: tuple, alternatives: list[Slotted], sm: int) -> str:
    """The SM's preferred backend's first variant of the slot (a backend's default tile); a conditional slot no
    preferred backend fills falls through."""
    preference = DEFAULT_PREFERENCE.get(sm, {}).get(family(kernel, slot), FALLBACK)
    by_backend: dict[str, str] = {}
    for v in alternatives:
        by_backend.setdefault(v.backend, v.label)
    pick = next((by_backend[b] for b in preference if b in by_backend), None)
    if pick is None:
        pick = "fallthrough" if slot[1] else alternatives[0].label
    return pick


def margin(selection: Selection) -> str:
    """How much the chosen variant won by, from tuning times: '1.83x over triton:dot_64'."""
    times = selection.times_us
    if len(selection.alternatives) == 1 and ", " not in selection.slot:
        return "-"  # nothing to choose from (a conditional slot competes with falling through)
    if selection.chosen not in times or len(times) < 2:
        return "untuned" if selection.by == "default" else "-"
    best = times[selection.chosen]
    runner, runner_up = min(((t, label) for label, t in times.items() if label != selection.chosen))
    return f"{runner / best:.2f}x over {runner_up}" if best > 0 else "-"


def used_scratch(variants: list[Variant], candidate_scratch: dict[str, TensorType]) -> dict[str, TensorType]:
    """The scratch buffers the variants' launches name (the runtime allocates these)."""
    used = {p.buffer for v in variants for launch in v.launches for p in launch.params}
    return {name: t for name, t in candidate_scratch.items() if name in used}


def slot_candidates(kernel: Kernel, selection: Selection) -> list[Variant]:
    """A selection's alternatives, as the kernel's candidates of that slot (one variant may serve several slots
    under one label, a TileLang decode tile the 1- and 4-row or the 4- and 16-row slots: the slot tells them
    apart)."""
    in_slot = {v.label: v for v in kernel.candidates if slot_key(v.slot) == selection.slot}
    return [in_slot[label] for label in selection.alternatives]


def reselect(manifest_path: Path, tuning: dict) -> None:
    """Chooses again among a manifest's compiled candidates, with no compiler: what `pegainfer tune` does on a
    GPU machine that has the cubins but not TileLang or CuTe DSL."""
    manifest = load(manifest_path)
    for kernel in manifest.kernels:
        kernel.variants, kernel.selection = choose(kernel, kernel.candidates, manifest.sm, tuning)
        kernel.scratch = used_scratch(kernel.variants, kernel.candidate_scratch)
    dump(manifest, manifest_path)
