"""`pegainfer tune`: on the GPU, time every slot's alternatives for the model's real shapes (decode buckets at a
1k context; GEMMs and attention of a 4k-token prefill), write the winners into the cache per
SM (sm_XX/tuning/<model>.json), and rewrite the manifest so the runtime launches them. A decode slot's runs each
read their own copy of the weights, as a decode step streams them from memory: with one copy the L2 would hold
much of a projection's weight, and favour tiles that lose in the decode step. A variant's deferred launch (a split
GEMM's sum of planes, which the norm launch after it adds itself) is not timed: true where that norm launch is
TileLang's (its 16-row default), not where tuning gives the next kernel's slot to another backend, whose launch
then reads the output summed, a launch more a layer (runtime/gpu/planes.py)."""

import json
import time
from pathlib import Path

from pegainfer.backends.manifest import check_lowering, load
from pegainfer.backends.select import slot_candidates, tuning_path
from pegainfer.ir.graph import Graph
from pegainfer.runtime.cuda import driver
from pegainfer.runtime.gpu.executor import PDL_MAX_TOKENS
from pegainfer.runtime.gpu.kernel_bench import (Buffers, kernel_types, launch_values, serving_variant, step_launches,
                                                 synthetic_step, time_launches, weight_names)

PREFILL_ROWS = 4096  # the unbounded GEMM slots and prefill attention are timed at this many tokens
DECODE_CONTEXT = 1024
WEIGHT_COPIES = 4  # one a run of the timing graph: 4 x 21 MB (o_proj of the 4B model) is past the H200's 50 MB L2


def slot_sizes(row_symbol: str, slot: tuple, block_size: int) -> tuple[dict, dict[str, int]]:
    """A synthetic step that lands in the slot (Slotted.slot: row bound, minimum sizes): its row bound (decode
    tokens, or sequences) or a prefill when unbounded or conditional."""
    bound, conditional = slot[0], bool(slot[1])
    if row_symbol in ("batch", "samples") and not conditional:
        return synthetic_step(bound or 64, 1, DECODE_CONTEXT, block_size)
    if bound is None or conditional:
        return synthetic_step(1, PREFILL_ROWS, PREFILL_ROWS, block_size)
    return synthetic_step(bound, 1, DECODE_CONTEXT, block_size)


def tune(ctx: driver.Context, manifest_path: Path, lowered: Graph, root: Path, spec, log=print) -> Path:
    manifest = load(manifest_path)
    check_lowering(manifest, manifest_path, lowered)
    folder = manifest_path.parent.parent
    buffers, functions, results = Buffers(ctx.stream), {}, {}
    for kernel in manifest.kernels:
        types, weights = kernel_types(lowered, kernel), weight_names(lowered, kernel)
        for selection in kernel.selection:
            variants = slot_candidates(kernel, selection)
            if len(variants) < 2 and not variants[0].min_sizes:
                continue
            step, sizes = slot_sizes(kernel.row_symbol, variants[0].slot, manifest.block_size)
            timed = [(v.label, v) for v in variants]
            if variants[0].min_sizes:
                timed.append(("fallthrough", serving_variant(kernel, sizes)))
            decode = variants[0].max_rows is not None and not variants[0].min_sizes
            times = {}
            for label, variant in timed:
                launches = step_launches(variant)
                envs = [buffers.env(launch_values(launches), types, sizes, step, frozenset(kernel.candidate_scratch),
                                    copy, weights) for copy in range(WEIGHT_COPIES if decode else 1)]
                times[label] = time_launches(ctx, folder, launches, envs, sizes, functions=functions,
                                             copies=WEIGHT_COPIES, pdl_max_tokens=PDL_MAX_TOKENS)
            choice = min(times, key=times.get)
            results.setdefault(f"{kernel.graph}/{kernel.node}", {})[selection.slot] = {
                "choice": choice, "times_us": times, "sizes": {k: sizes[k] for k in ("tokens", "batch")}}
            log(f"{kernel.node:<16} {selection.slot:<34} " + "  ".join(
                f"{label} {us:.1f} us{' *' if label == choice else ''}" for label, us in times.items()))
    path = tuning_path(root, manifest.sm, spec)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"model_id": manifest.model_id, "device": ctx.name(), "sm": manifest.sm,
                                "tuned_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "kernels": results}, indent=1))
    return path
