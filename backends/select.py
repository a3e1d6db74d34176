"""Choosing one variant per slot of each kernel among the backends' candidates, per SM. A slot is a row bound
(and minimum step sizes): its variants are alternatives. `pegainfer tune` times them on the GPU for the model's
shapes and writes the winner per slot into the cache; without tuning data the default below decides.

Default (until tuning says otherwise), per SM and kernel family, from the H200 measurements in docs/BENCHMARKS.md
(2026-11-30 to 2026-12-01): on sm_90 the prefill GEMMs and prefill attention go to TileLang (its default tile beat
Triton's on every prefill GEMM of the 4B benchmark model at 4k and 8k rows, by 1.4x to 8.5x, and its attention ran 3.5x
faster at 8k), and so do the decode GEMMs of 2 to 16 rows (its TMA-streamed tiles beat every Triton variant there, by
1.02x to 1.41x, session 6; at 4 rows its normed tile (GEMMs with a norm) and its swapped tile (o_proj, down) lead, which
made the batch-2 and batch-4 steps 4-7% faster, session 10, a K split over a cluster 4-6% more, session 12, and the
swapped tile over both K halves of 8 weight rows a CTA, which replaced it: o_proj 8-10% faster, down the same, session
14; at 16 rows the K split of o_proj and down into fp32 planes that the next norm launch adds: steps at batch 8 and
16 3-4% faster, session 16) and of one row: the normed tile for QKV and gate/up (the batch-1 step 5% faster, session
9), the halved tile for o_proj and down (83% / 85% of the copy bandwidth for Triton's one-row GEMV, 87% / 92% for it;
the batch-1 step 2.47 ms against 2.53, session 14, where the cluster tile at one row had made it 1.5% slower, session
12). CuTe DSL's GEMVs won some slots in isolation but made the batch-1 step slower. Every other SM, and every
family without an entry, is Triton's. A backend not compiled into the cache falls back to the next."""

import json
from pathlib import Path
from typing import Any

from pegainfer.backends.cache import model_id, sm_folder
from pegainfer.backends.spec import KernelSpec, VariantSpec

DEFAULT_PREFERENCE: dict[int, dict[str, tuple[str, ...]]] = {
    90: {"gemm": ("tilelang", "triton"), "gemv": ("tilelang", "triton"), "attention": ("tilelang", "triton")},
}
FALLBACK = ("triton",)


def family(kernel: KernelSpec, slot: tuple) -> str:
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


def slots(variants: list[VariantSpec]) -> dict[tuple, list[VariantSpec]]:
    """Slot -> its alternatives, slots ordered as the runtime tries them: conditional ones (minimum sizes) first,
    then by row bound, unbounded last."""
    grouped: dict[tuple, list[VariantSpec]] = {}
    for variant in variants:
        grouped.setdefault(variant.slot, []).append(variant)
    order = sorted(grouped, key=lambda s: (not s[1], s[0] is None, s[0] or 0))
    return {slot: grouped[slot] for slot in order}


def choose(kernel: KernelSpec, variants: list[VariantSpec], sm: int, tuning: dict) -> tuple[list, list[dict]]:
    """(the chosen variants in the runtime's order, one selection record per slot). A conditional slot may be
    left empty (its steps fall through to the next slot) when the chosen backend has nothing there."""
    tuned = tuning.get("kernels", {}).get(f"{kernel.graph}/{kernel.node}", {})
    chosen, records = [], []
    for slot, alternatives in slots(variants).items():
        key = slot_key(slot)
        labels = [v.label for v in alternatives]
        record = {"slot": key, "alternatives": labels}
        if key in tuned and tuned[key]["choice"] in labels + ["fallthrough"]:
            pick = tuned[key]["choice"]
            record.update(by="tuned", times_us=tuned[key].get("times_us", {}))
        else:
            preference = DEFAULT_PREFERENCE.get(sm, {}).get(family(kernel, slot), FALLBACK)
            by_backend: dict[str, str] = {}
            for v in alternatives:  # a backend's first variant of the slot is its default tile
                by_backend.setdefault(v.backend, v.label)
            pick = next((by_backend[b] for b in preference if b in by_backend), None)
            if pick is None:
                pick = "fallthrough" if slot[1] else labels[0]
            record.update(by="default")
        record["chosen"] = pick
        records.append(record)
        chosen += [v for v in alternatives if v.label == pick]
    return chosen, records


def margin(record: dict) -> str:
    """How much the chosen variant won by, from tuning times: '1.83x over triton:many_rows'."""
    times = record.get("times_us") or {}
    if len(record["alternatives"]) == 1 and ", " not in record["slot"]:
        return "-"  # nothing to choose from (a conditional slot competes with falling through)
    if record["chosen"] not in times or len(times) < 2:
        return "untuned" if record["by"] == "default" else "-"
    best = times[record["chosen"]]
    runner, runner_up = min(((t, label) for label, t in times.items() if label != record["chosen"]))
    return f"{runner / best:.2f}x over {runner_up}" if best > 0 else "-"


def used_scratch(record: dict) -> dict:
    """The scratch buffers the chosen variants' launches name (the runtime allocates these)."""
    used = {p["value"] for v in record["variants"] for launch in v["launches"] for p in launch["params"]}
    return {name: shape for name, shape in record["candidate_scratch"].items() if name in used}


def candidate_spec(candidate: dict) -> VariantSpec:
    """A manifest candidate as a VariantSpec without launches: enough to know its slot and label."""
    return VariantSpec(candidate["name"], candidate["max_rows"], [], candidate["backend"], candidate["min_sizes"])


def slot_candidates(kernel: dict, record: dict) -> list[dict]:
    """A selection record's alternatives, as the manifest's candidates of that slot (one variant may serve several
    slots under one label, a TileLang decode tile the 1- and 4-row or the 4- and 16-row slots: the slot tells them
    apart)."""
    in_slot = {candidate_spec(v).label: v for v in kernel["candidates"]
               if slot_key(candidate_spec(v).slot) == record["slot"]}
    return [in_slot[label] for label in record["alternatives"]]


def reselect(manifest_path: Path, tuning: dict) -> None:
    """Chooses again among a manifest's compiled candidates, with no compiler: what `pegainfer tune` does on a
    GPU machine that has the cubins but not TileLang or CuTe DSL."""
    data = json.loads(manifest_path.read_text())
    for record in data["kernels"]:
        kernel = KernelSpec(record["graph"], record["node"], record["kind"], record["ops"], record["row_symbol"])
        variants = [candidate_spec(v) for v in record["candidates"]]
        chosen, record["selection"] = choose(kernel, variants, data["sm"], tuning)
        by_slot = {(v.slot, v.label): candidate for v, candidate in zip(variants, record["candidates"])}
        record["variants"] = [by_slot[(v.slot, v.label)] for v in chosen]
        record["scratch"] = used_scratch(record)
    manifest_path.write_text(json.dumps(data, indent=1))
