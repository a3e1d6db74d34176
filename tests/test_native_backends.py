"""Every TileLang and CuTe DSL kernel of Qwen3-4B compiled on this CPU machine to cubins for sm_90a and sm_80 (the
default TileLang variant of each slot; each extra tuning variant compiled once, for one kernel);
the TileLang GEMM's and attention's sm_90a SASS runs on HGMMA (and TMA loads for the GEMM), the decode tiles' on TMA
and mma.sync within the CTAs an SM must hold, gate/up's freeing a row stage only after both GEMMs; each launch ABI the
manifest would record agrees with the DSL's own host launcher: TileLang's generated C++ stub (argument order,
grid and block expressions, dynamic shared memory, every TMA descriptor field) and CuTe DSL's host IR (the
launch configuration and kernelParams it builds)."""

import re
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("tilelang")
pytest.importorskip("cutlass")

from pegainfer.backends.build import compile_many, plan_model  # noqa: E402
from pegainfer.backends.spec import GridDim  # noqa: E402
from pegainfer.backends.tilelang.plan import DEFAULT_VARIANTS  # noqa: E402
from pegainfer.backends.planning import PlanOptions  # noqa: E402
from pegainfer.frontends.load import embedded_configs, load_spec  # noqa: E402

pytestmark = pytest.mark.slow
SMS = (90, 80)


@pytest.fixture(scope="module")
def kernels():
    spec = load_spec(embedded_configs()["qwen3-4b"])
    return plan_model(spec, PlanOptions(), ("triton", "tilelang", "cute"))[1]


@pytest.fixture(scope="module")
def compiled(kernels):
    todo, where = {}, {}
    for kernel in kernels:
        for variant in kernel.variants:
            if variant.backend == "triton" or (variant.backend == "tilelang" and variant.name not in DEFAULT_VARIANTS):
                continue
            for sm in SMS:
                if sm in variant.sms:
                    for index, launch in enumerate(variant.launches):
                        if launch.backend == "triton":  # a mixed step's decode rows (Triton's tests)
                            continue
                        key = f"{kernel.node}/{variant.name}/{index}"
                        todo[(sm, key)] = launch
                        where[(sm, key)] = (kernel, variant)
    results = dict(compile_many(todo, 2, None))
    return todo, where, results


def sass(cubin: bytes, tmp_path: Path) -> str:
    import triton
    path = tmp_path / "k.cubin"
    path.write_bytes(cubin)
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return subprocess.run([str(tool), "-sass", str(path)], capture_output=True, text=True, check=True).stdout


def test_every_kernel_compiles_for_sm90a_and_sm80(compiled):
    todo, where, results = compiled
    for sm in SMS:
        kinds = {(where[(s, k)][0].kind, where[(s, k)][1].backend) for (s, k) in todo if s == sm}
        assert {("linear", "tilelang"), ("add_rms_norm_linear", "tilelang"), ("paged_attention", "tilelang"),
                ("add_rms_norm_linear_silu_mul", "tilelang"), ("linear", "cute"),
                ("add_rms_norm_linear", "cute"), ("add_rms_norm_linear_silu_mul", "cute")} <= kinds
    for (sm, key), native in results.items():
        assert native.cubin[:4] == b"\x7fELF", key
        assert native.threads % 32 == 0 and native.abi, key
        target = re.search(r"^\.target\s+(\S+)", native.files["ptx"], re.M).group(1)
        assert target == ("sm_90a" if sm == 90 else "sm_80"), (key, target)


def test_tilelang_sm90a_gemm_and_attention_run_on_hgmma(compiled, tmp_path):
    _, where, results = compiled
    gemm = next(n for (sm, k), n in results.items() if sm == 90 and k.startswith("down/wgmma_"))
    code = sass(gemm.cubin, tmp_path)
    assert "HGMMA" in code and "UTMALDG" in code
    assert [p["kind"] for p in gemm.abi] == ["tma", "tma", "tma", "dim"]
    attention = next(n for (sm, k), n in results.items() if sm == 90 and k.startswith("attention/"))
    assert "HGMMA" in sass(attention.cubin, tmp_path)
    sm80 = next(n for (sm, k), n in results.items() if sm == 80 and k.startswith("down/"))
    assert "HGMMA" not in sass(sm80.cubin, tmp_path) and "HMMA" in sass(sm80.cubin, tmp_path)


TUNING_VARIANTS = {"wgmma_128x128": "gate_up", "wgmma_fullrow_128x256": "o_proj", "wgmma_fullrow_256x128": "down",
                   "mma_16x64": "o_proj", "mma_16x32": "down", "decode_tile_16x64": "gate_up",
                   # the swapped tiles of 17-256 rows (swapped_plan.py): each family and row width once, the split
                   # form (K over the grid, its slices summed after it) on o_proj and down
                   "wgmma_swapped_32x64": "gate_up", "wgmma_swapped_64x64": "gate_up", "wgmma_swapped_128x64": "down",
                   "wgmma_swapped_deep_32x64": "qkv", "wgmma_swapped_deep_64x64": "qkv",
                   "wgmma_swapped_deep_128x64": "qkv", "wgmma_swapped_32x128": "gate_up",
                   "wgmma_swapped_64x128": "o_proj", "wgmma_swapped_128x128": "gate_up"}


def test_every_tilelang_variant_is_compiled_by_some_test(kernels):
    names = {v.name for k in kernels for v in k.variants if v.backend == "tilelang"}
    assert names == set(DEFAULT_VARIANTS) | set(TUNING_VARIANTS)


@pytest.mark.parametrize("name", sorted(TUNING_VARIANTS))
def test_tilelang_tuning_variant_compiles_for_sm90a(kernels, name, tmp_path):
    """Each extra variant `pegainfer tune` may choose, on one kernel: its form's instruction in its SASS (HGMMA for
    wgmma, mma.sync's HMMA for the 16-row tiles), fed by TMA, and no register spills."""
    kernel = next(k for k in kernels if k.node == TUNING_VARIANTS[name])
    variant = next(v for v in kernel.variants if v.name == name)
    gemm = next(launch for launch in reversed(variant.launches) if launch.function != "sum_slices")
    todo = {(90, f"{kernel.node}/{name}"): gemm}
    ((_, native),) = compile_many(todo, 1, None)
    assert native.resources["spill_stores"] == 0, native.resources
    code = sass(native.cubin, tmp_path)
    assert ("HGMMA" if name.startswith("wgmma_") else "HMMA") in code and "UTMALDG" in code


def test_tilelang_decode_tiles_stream_weights_by_tma_and_fit_their_ctas_per_sm(compiled, tmp_path):
    """The decode tiles: weights by TMA (UTMALDG), the step's rows by predicated cp.async (LDGSTS: no TMA box
    past the rows), mma.sync (HMMA), and registers and shared memory that let an SM hold MIN_BLOCKS CTAs."""
    todo, _, results = compiled
    keys = [key for (sm, key) in results if sm == 90 and "/decode_" in key]
    assert {key.split("/")[1] for key in keys} == {"decode_tile_16x16", "decode_normed_4x16", "decode_halved_4x8",
                                                   "decode_planes_16x32"}
    for key in keys:
        launch, native = todo[(90, key)], results[(90, key)]
        if launch.function in ("add_rms_norm", "sum_planes"):
            continue  # the norm launch before a GEMM with a norm; a split GEMM's deferred sum
        code = sass(native.cubin, tmp_path)
        assert "UTMALDG" in code and "LDGSTS" in code and "HMMA" in code and "HGMMA" not in code, key
        blocks = launch.constexprs["MIN_BLOCKS"]
        assert native.resources["spill_stores"] == 0 and native.resources["registers"] * native.threads * blocks \
            <= 65536, (key, native.resources, native.threads)
        assert blocks * (native.shared + native.resources["shared"] + 1024) <= 228 * 1024, (key, native.shared)


def test_tilelang_merged_gate_up_is_one_wgmma_n256_per_k_step(compiled, tmp_path):
    """The merged gate/up tile: the gate and up rows land in one shared tile and one m64n256 wgmma batch per K step
    reads them (one wgmma call site in the generated CUDA, HGMMA.64x256x16 in the SASS), within the registers and
    the 227 KB of shared memory a block may opt into; its SiLU takes the approximate exp and reciprocal (expf and
    an IEEE division cost the tile 7-9% on the H200)."""
    _, _, results = compiled
    native = results[(90, "gate_up/wgmma_merged_128x256/1")]  # launch 0 is the norm
    assert native.resources["spill_stores"] == 0 and native.resources["spill_loads"] == 0, native.resources
    wgmma = re.findall(r"tl::wgmma_ss<[^>]*>", native.files["cu"])
    assert len(wgmma) == 1 and ", 64, 256, 16," in wgmma[0], wgmma
    assert "HGMMA.64x256x16" in sass(native.cubin, tmp_path)
    assert native.shared + native.resources["shared"] <= 227 * 1024, (native.shared, native.resources)
    assert "__expf(" in native.files["cu"] and "fast_rcp(" in native.files["cu"]
    assert not re.search(r"(?<!_)expf\(", native.files["cu"])


def _evaluate(expression: str, names: list[str], m: int) -> int:
    """The stub's C integer arithmetic with every dynamic size bound to m."""
    return eval(expression.replace("/", "//"), {}, {name: m for name in names})


@pytest.mark.parametrize("key", ["gate_up/wgmma_fullrow_128x128/1", "attention/flash_128x128/0",
                                 "attention/flash_ws_128x128/0", "attention/mixed_16_ws_128x128/1",
                                 "down/decode_halved_4x8/0"])
def test_tilelang_abi_matches_its_host_stub(compiled, key):
    from pegainfer.backends.tilelang.compiler import host_stub

    todo, _, results = compiled
    launch, native = todo[(90, key)], results[(90, key)]
    stub = host_stub(launch, 90)
    symbol, args = re.search(r"cudaLaunchKernelEx\(&config, (\w+), (.*?)\);", stub).groups()
    assert symbol == native.function
    assert [a.strip() for a in args.split(",")] == [p["name"] for p in native.abi]
    grid = re.search(r"config\.gridDim = dim3\((.*?)\);", stub).group(1).split(", ")
    symbols = {p["name"]: p["value"] for p in native.abi if p["kind"] in ("dim", "stride", "rows", "plane_rows")}
    for m in (1, 129, 4096):
        sizes = {symbols[name]: m for name in symbols}
        assert [_evaluate(e, list(symbols), m) for e in grid] == [GridDim.size(d, sizes) for d in launch.grid]
    assert re.search(r"config\.blockDim = dim3\((\d+), 1, 1\)", stub).group(1) == str(native.threads)
    assert int(re.search(r"config\.dynamicSmemBytes = (\d+);", stub).group(1)) == native.shared
    clusters = re.findall(r"val\.clusterDim = \{(\d+), (\d+), (\d+)\};", stub)  # TileLang's launch asks for it
    assert [tuple(map(int, c)) for c in clusters] == ([] if native.cluster == (1, 1, 1) else [native.cluster])
    for param in (p for p in native.abi if p["kind"] == "tma"):
        d, name = param["tma"], param["name"]

        def field(what: str) -> list[str]:
            return re.search(rf"{name}_{what}\[\d\]= \{{(.*?)\}};", stub).group(1).split(",")
        as_text = [str(x) if isinstance(x, int) else "M" for x in d["dims"]]
        assert field("globalDim") == as_text
        assert field("globalStride") == [str(x) for x in d["strides"]]
        assert field("boxDim") == [str(x) for x in d["box"]]
        assert field("elementStrides") == [str(x) for x in d["element_strides"]]
        assert re.search(rf"{name}_swizzle= \(CUtensorMapSwizzle\)(\d+);", stub).group(1) == str(d["swizzle"])
        assert re.search(rf"{name}_type= \(CUtensorMapDataType\)(\d+);", stub).group(1) == str(d["dtype"])


def test_cute_abi_matches_its_host_launcher(compiled):
    from pegainfer.backends.cute.compiler import compile_to_files, launch_config, ptx_entry

    todo, _, results = compiled
    key = "qkv/gemv_4/0"
    _, _, host_ir = compile_to_files(todo[(90, key)], 90)
    native = results[(90, key)]
    config = launch_config(host_ir)
    assert config["block"] == [native.threads, 1, 1] and config["shared"] == native.shared
    assert config["grid"] == [GridDim.size(d, {}) for d in todo[(90, key)].grid]
    launcher = next(body for body in host_ir.split("llvm.func ") if "llvm.call @_cudaLaunchKernelEx(" in body)
    kernel_params = re.findall(r"llvm\.alloca (%\d+) x !llvm\.ptr :", launcher)
    count = re.search(rf"{kernel_params[-1]} = llvm\.mlir\.constant\((\d+) : i32\)", launcher)
    assert count and int(count.group(1)) == len(native.abi) == len(ptx_entry(native.files["ptx"])[1])
    assert [p["kind"] for p in native.abi] == ["tensor"] * 6 + ["dim"]


def _compile_attention(kernels, name: str):
    kernel = next(k for k in kernels if k.node == "attention")
    variant = next(v for v in kernel.variants if v.name == name)
    ((_, native),) = compile_many({(90, f"attention/{name}"): variant.launches[-1]}, 1, None)
    return native


def test_tilelang_overlapped_attention_runs_its_softmax_under_the_pv_product(kernels, tmp_path):
    """flash_ws_128x128's point is the softmax of S_k (MUFU.EX2) between the wait for S_k (wgmma groups pending
    <= 1) and the wait for P_{k-1} V_{k-1} (<= 0) in its SASS; ptxas is free to hoist a wait, and a hoisted one
    would serialise the softmax behind the product again."""
    code = sass(_compile_attention(kernels, "flash_ws_128x128").cubin, tmp_path)
    between = code.split("WARPGROUP.DEPBAR.LE gsb0, 0x1", 1)[1].split("WARPGROUP.DEPBAR.LE gsb0, 0x0", 1)[0]
    assert between.count("MUFU.EX2") >= 64 and "SHFL.BFLY" in between


def test_tilelang_warp_specialised_attention_has_no_block_barrier_in_its_loop(kernels, tmp_path):
    """flash_ws_128x128: a producer warpgroup (setmaxnreg down to 24) and 256 consumer threads (up to 240), no
    spills. The consumers' key loop synchronises through the full/empty mbarriers only: it waits for K_k and
    V_{k-1}, releases K_k once S_k is done and V_{k-1} once P V is, with no __syncthreads or named barrier; the
    block-wide barrier is the one after the mbarriers' init, and TileLang's consumer-only ones (256 threads) order
    the query tile and the output staged in it. The producer signals a stage with cp.async.mbarrier.arrive.noinc
    (ARRIVES.LDGSTSBAR) and never waits for its own copies but once, before it exits."""
    native = _compile_attention(kernels, "flash_ws_128x128")
    assert native.threads == 384
    assert native.resources["spill_stores"] == 0 and native.resources["spill_loads"] == 0, native.resources
    cu = native.files["cu"]
    loop = re.search(r"for \(int (tile_\d+) = 1;.*?\n      }\n", cu, re.S).group(0)
    assert not re.search(r"__sync|\bbar\.", loop), loop
    assert re.findall(r"(\w+)\[[^]]*\]\.wait\(", loop) == ["k_full", "v_full"]
    assert re.findall(r"(\w+)\[[^]]*\]\.arrive\(\)", loop) == ["k_empty", "v_empty"]
    code = sass(native.cubin, tmp_path)
    assert "USETMAXREG.DEALLOC.CTAPOOL 0x18" in code and "USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xf0" in code
    assert "ARRIVES.LDGSTSBAR" in code and "HGMMA" in code
    barriers = re.findall(r"BAR\.SYNC\.DEFER_BLOCKING ([^;]*?) *;", code)
    assert barriers[0] == "0x0" and all(b == "0x3, 0x100" for b in barriers[1:]), barriers


def test_tilelang_silu_mul_decode_tile_frees_a_row_stage_after_both_gemms(compiled):
    """gate/up's decode tile: its consumers hand a stage back to the producer only after the up GEMM has read its
    rows too (TileLang's own warp specialisation of a two-GEMM mma.sync tile released it after the first, and the
    next rows overwrote the stage under the second: wrong results on the H200)."""
    _, _, results = compiled
    native = results[(90, "gate_up/decode_tile_16x16/1")]
    code = native.files["cu"]
    consumer = code[code.index("} else {"):]
    loop = consumer[:consumer.index("empty[")]
    assert "a_full[" in loop and loop.count("tl::mma_sync") == 2, loop[-600:]
    assert "(up + " in loop.split("tl::mma_sync")[-1] and "(acc + " in loop.split("tl::mma_sync")[1]


def test_tilelang_decode_tile_with_pdl_streams_weights_before_waiting_for_the_previous_kernel(compiled):
    """o_proj's 16-row tile (decode_tile.py, launched programmatically): every CTA lets the next kernel launch first;
    the producer issues its first weight stages by TMA, then waits for the previous kernel, and only then loads the
    rows; its ABI is the rows, the output, the weights' TMA descriptor and M."""
    todo, _, results = compiled
    launch, native = todo[(90, "o_proj/decode_tile_16x16/0")], results[(90, "o_proj/decode_tile_16x16/0")]
    code = native.files["cu"]
    producer_branch = f"if ({launch.constexprs['THREADS']} <= ((int)threadIdx.x))"
    assert code.index("cudaTriggerProgrammaticLaunchCompletion") < code.index(producer_branch)
    producer = code[code.index(producer_branch):code.index("} else {")]
    wait = producer.index("cudaGridDependencySynchronize")
    assert "tma_load" in producer[:wait] and "cp_async" not in producer[:wait] and "cp_async" in producer[wait:]
    assert [a["name"] for a in native.abi] == ["A", "C", "W_desc", "M"]


def normed_tile_parts(code: str) -> tuple[str, str, str, str]:
    """A normed tile's CUDA in its roles: the producer's code before the wait for the previous kernel, the
    producer's after it, the scalers' (threads 160-287) and the consumer warp's."""
    scalers = code[code.index("if (160 <= ((int)threadIdx.x))"):code.index("rstd_full[0].arrive();")]
    producer = code[code.index("if (32 <= ((int)threadIdx.x))"):]
    producer, consumer = producer[:producer.index("} else {")], producer[producer.index("} else {"):]
    wait = producer.index("cudaGridDependencySynchronize")
    return producer[:wait], producer[wait:], scalers, consumer


def test_tilelang_normed_qkv_tile_copies_g_whole_before_the_wait(compiled):
    """QKV's 1- and 4-row tile with the norm inside: before the wait for the previous kernel the producer issues two
    weight stages and copies G whole (a weight: it never depends on that kernel), no rows; after it each step's
    rows and X2's go out before the step's weights, never waiting for them to land; the scalers wait for each
    step's landing (which also covers G, copied by the same threads first), write the residual sum, multiply by G
    at the step's columns, split the result into the high part and remainder, and end with each row's 1/rms; the
    consumer warp runs two mma chains, then adds both halves' products times 1/rms. ABI: rows, X2, G, the sum S
    and the weights' TMA descriptor."""
    todo, _, results = compiled
    launch, native = todo[(90, "qkv/decode_normed_4x16/0")], results[(90, "qkv/decode_normed_4x16/0")]
    assert launch.constexprs["PRE"] == 2 and launch.constexprs["CHAINS"] == 2 and native.threads == 288
    assert [a["name"] for a in native.abi] == ["A", "C", "G", "S", "W_desc", "X2", "M"]
    ahead, loop, scalers, consumer = normed_tile_parts(native.files["cu"])
    assert "for (int k_1 = 0; k_1 < 2; ++k_1)" in ahead and "w_full[k_1].expect_transaction(8192)" in ahead
    assert ahead.index("tl::tma_load(W_desc") < ahead.index("(&(G[") and "(&(A[" not in ahead and "(&(X2[" not in ahead
    assert "(&(G[" not in loop and "landed[" not in loop.replace("mbarrier_cp_async_arrive_noinc(landed[", "")
    assert loop.index("(&(A[") < loop.index("(&(X2[") < loop.index("tl::tma_load(W_desc")
    assert scalers.index("landed[(k % 5)].wait") < scalers.index("(S + ") < scalers.index("a_full[(k % 5)].arrive()")
    assert re.search(r"g_s\) \+ \(+k \* 256\)", scalers), scalers  # G at the step's 256 columns
    assert re.search(r"__\d+\.x = \(v__\d+\.x-__\d+\.x\)", scalers) and "rsqrtf(" in scalers
    chains = re.findall(r"mma_sync<[^>]*>\(reinterpret_cast<float\*>\((\w+) \+ 0\)", consumer)
    assert chains == ["acc", "up"], chains
    epilogue = consumer[consumer.index("rstd_full[0].wait(0)"):]
    assert "sums[" in epilogue and "* rstd[" in epilogue and "expf(" not in epilogue


def test_tilelang_normed_gate_up_tile_scales_its_rows_in_a_warpgroup_of_scalers(compiled):
    """gate/up's normed tile: the producer (threads 32-159) issues one weight stage of gate and of up and copies G
    before the wait, then each step's rows, X2's, then the step's weights, never waiting for rows to land; the
    scalers (threads 160-287) wait for each step's rows, write the residual sum, scale them into the high part and
    remainder, hand the stage to the consumer warp, and end with each row's 1/rms; the consumer warp scales both
    halves' products by 1/rms before SiLU x up."""
    todo, _, results = compiled
    launch, native = todo[(90, "gate_up/decode_normed_4x16/0")], results[(90, "gate_up/decode_normed_4x16/0")]
    assert launch.constexprs["PRE"] == 1 and launch.num_warps == 9 and native.threads == 288
    assert [a["name"] for a in native.abi] == ["A", "C", "G", "S", "W_desc", "X2", "M"]
    ahead, loop, scalers, consumer = normed_tile_parts(native.files["cu"])
    assert scalers.index("landed[(k % 3)].wait") < scalers.index("(S + ") < scalers.index("a_full[(k % 3)].arrive()")
    assert re.search(r"__\d+\.x = \(v__\d+\.x-__\d+\.x\)", scalers) and "rsqrtf(" in scalers
    assert ahead.count("tl::tma_load(W_desc") == 2 and "(&(G[" in ahead and "(&(A[" not in ahead
    assert "landed[" not in loop.replace("mbarrier_cp_async_arrive_noinc(landed[", "") and "a_full" not in loop
    assert "(&(G[" not in loop and loop.index("(&(A[") < loop.index("(&(X2[") < loop.index("tl::tma_load(W_desc")
    epilogue = consumer[consumer.index("rstd_full[0].wait(0)"):]
    assert "sums[" in epilogue and "* rstd[" in epilogue and "expf(" in epilogue


def test_tilelang_four_chain_tile_sums_each_stage_quarter_into_its_own_accumulator(compiled, tmp_path):
    """down's 1- and 4-row tile (decode_halved.py, CHAINS=4): the weight tile is mma.sync's A operand (ldmatrix x4
    from the weight stage) and the rows its B (x2 from the 8-row stage), m16n8k16; each stage's four K quarters (4
    k-steps of 16) go to mma.sync into four accumulators in turn, whose sum is stored; in the SASS no HMMA
    accumulates onto the one just before it (a single chain's all do)."""
    native = compiled[2][(90, "down/decode_halved_4x8/0")]
    consumer = native.files["cu"][native.files["cu"].index("} else {"):]
    assert re.search(r"ptx_ldmatrix_x4\(\(&\(\(\(bfloat16_t\*\)w_s\)", consumer), consumer[:800]
    assert re.search(r"ptx_ldmatrix_x2\(\(&\(\(\(bfloat16_t\*\)a_s\)", consumer)
    assert "16, 8, 16, false, true>" in consumer
    chains = re.findall(r"mma_sync<[^>]*>\(reinterpret_cast<float\*>\((\w+) \+ 0\)", consumer)
    assert chains == ["acc", "up", "third", "fourth"], chains
    assert consumer.count("for (int ki") == 4 and "ki < 4;" in consumer
    summed = consumer[consumer.rindex("empty[(k_2 % 6)].arrive();"):]
    assert all(f"*(float4*)({name} + 0)" in summed for name in chains) and "*(float4*)(acc + 0) = " in summed
    hmma = re.findall(r"HMMA\.\S+ (R\d+), R\d+, R\d+, (R\d+)", sass(native.cubin, tmp_path))
    assert len(hmma) >= 16 and not [b for a, b in zip(hmma, hmma[1:]) if b[1] == a[0]], hmma  # one chain: all are


def test_tilelang_halved_tile_streams_both_k_halves_of_eight_weight_rows(compiled):
    """o_proj's and down's 1- and 4-row tile (decode_halved.py): the weights' TMA descriptor reads W as [2N, K/2] in
    boxes of 16 rows (8 weight rows over both halves), each step's 4 rows go out twice, at the step's column and half
    K past it, the grid is 8 columns by 4 rows, and the epilogue adds products (2i, r) and (2i + 1, r + 4) of the
    [16, 8] tile: like halves of weight row i and row r."""
    todo, _, results = compiled
    launch, native = todo[(90, "down/decode_halved_4x8/0")], results[(90, "down/decode_halved_4x8/0")]
    n, k = launch.constexprs["N"], launch.constexprs["K"]
    (descriptor,) = [p["tma"] for p in native.abi if p["kind"] == "tma"]
    assert descriptor["dims"] == [k // 2, 2 * n] and descriptor["strides"][1] == k and descriptor["box"][1] == 16
    assert (launch.grid[0].block, launch.grid[1].block) == (8, 4)
    code = native.files["cu"]
    producer = code[code.index("cudaGridDependencySynchronize"):code.index("} else {")]
    rows = re.findall(r"\(&\(A\[(.*?)\]\)\)", producer)
    assert len(rows) == 2 and f"(int64_t){k // 2})" in rows[1] and f"(int64_t){k // 2}" not in rows[0], rows
    store = re.search(r"\] = \(\(bfloat16_t\)\(sums\[(.*?)\] \+ sums\[(.*?)\]\)\);", code)
    for thread in range(32):
        first, second = (eval(e.replace("((int)threadIdx.x)", str(thread))) for e in store.groups())
        assert second == first + 8 + 4 and first % 16 < 4, (thread, first, second)  # (2i, r) -> (2i + 1, r + 4)
    # stages issued before the wait: o_proj's 8 steps SHORT_PRE of them, down's 19 all its STAGES
    from pegainfer.backends.tilelang.plan import SHORT_PRE

    for node, ahead in (("o_proj", SHORT_PRE), ("down", launch.constexprs["STAGES"])):
        code = results[(90, f"{node}/decode_halved_4x8/0")].files["cu"]
        before = code[code.index("if (32 <= ((int)threadIdx.x))"):code.index("cudaGridDependencySynchronize")]
        assert re.findall(r"for \(int k = 0; k < (\d+); \+\+k\)", before) == [str(ahead)], node


def test_tilelang_split_gemm_leaves_its_planes_to_the_norm_launch_after_it(compiled, tmp_path):
    """o_proj's and down's 16-row tile (decode_planes.py) stores its fp32 planes with no fence, ticket or C; the
    deferred sum adds them in plane order into C; the norm launch after o_proj adds up to 4 planes of its X2 (their
    loads issued together, each predicated on the planes there are, PR: a branch a plane waited for each in turn)
    where they are given, X2 as stored where not."""
    todo, _, results = compiled
    for node in ("o_proj", "down"):
        gemm_key, total_key = (90, f"{node}/decode_planes_16x32/0"), (90, f"{node}/decode_planes_16x32/1")
        gemm, total = results[gemm_key], results[total_key]
        code = gemm.files["cu"]
        assert "P[" in code or "(P + " in code
        assert "tickets" not in code and "__threadfence" not in code and "atomic" not in code.lower()
        assert [(p["kind"], p["value"]) for p in gemm.abi if p["kind"] in ("tensor", "planes")] == [
            ("tensor", "gated" if node == "down" else "attention_flat"), ("planes", node)]
        assert todo[total_key].deferred and not todo[gemm_key].deferred
        assert {(p["kind"], p["value"]) for p in total.abi} >= {("planes", node), ("tensor", node)}
    norm = results[(90, "gate_up/decode_tile_16x16/0")]
    body = norm.files["cu"][norm.files["cu"].index("add_rms_norm_kernel("):]
    assert "for (int s = 0; s < 4; ++s) {" in body and "(0 < PR)" in body
    assert body.index("cudaGridDependencySynchronize") < body.index("(P + ") < body.index("AllReduce")
    # each plane's loads predicated on PR, not behind a branch a plane: 3 planes' 5 16-byte loads at least
    assert len(re.findall(r"@!?P\d+ LDG\.E\.128", sass(norm.cubin, tmp_path))) >= 15


def test_tilelang_norm_launch_loads_its_weight_before_waiting_for_the_previous_kernel(compiled):
    """The norm launch before a decode GEMM (PDL): G, a weight, is loaded first, then the wait for the previous
    kernel, then the rows; so the only round trips after the wait are the rows' and the stores."""
    todo, _, results = compiled
    keys = [key for (sm, key) in results if sm == 90 and key.startswith("qkv/decode_tile_16x16/")
            and todo[(sm, key)].function == "add_rms_norm"]
    assert len(keys) == 1
    code = results[(90, keys[0])].files["cu"]
    body = code[code.index("add_rms_norm_kernel("):]
    assert body.index("cudaTriggerProgrammaticLaunchCompletion") < body.index("(G + ") < body.index(
        "cudaGridDependencySynchronize") < body.index("(X + ") < body.index("AllReduce") < body.index("(Y + ")
    assert body.count("(G + ") == 1, "G is read once, before the wait"


def test_tilelang_launches_declare_programmatic_launch_in_the_manifest_as_their_ptx_waits(compiled):
    """A TileLang launch's manifest record says `pdl` exactly when its template took PDL=True, and then its PTX waits
    for the previous kernel (griddepcontrol.wait): the runtime launches only those programmatically."""
    from pegainfer.backends.build import _entry_files_and_meta

    todo, _, results = compiled
    seen = set()
    for (sm, key), native in results.items():
        launch = todo[(sm, key)]
        if launch.backend != "tilelang":
            continue
        pdl = _entry_files_and_meta(native, launch)[1]["pdl"]
        assert pdl == ("griddepcontrol.wait" in native.files["ptx"]), key
        seen.add(pdl)
    assert seen == {True, False}


def norm_weight_readers(name: str, quantization: str | None = None, overrides: dict | None = None) -> dict:
    """The first native launch of each kind that reads a norm's weight G in the model's plan, by (function,
    ACT, PDL, PLANES): rows.py's norm launch (prefill's, the decode tiles' with PDL and X2's planes) and FP8
    quantizing launch, decode_normed.py's tile, CuTe's GEMV."""
    import json
    import tempfile

    config = embedded_configs()[name]
    with tempfile.TemporaryDirectory() as folder:
        if overrides:
            config = Path(folder) / "config.json"
            config.write_text(json.dumps(json.loads(embedded_configs()[name].read_text()) | overrides))
        spec = load_spec(config, quantization=quantization)
    readers = {}
    for kernel in plan_model(spec, PlanOptions(), ("triton", "tilelang", "cute"))[1]:
        for launch in (launch for v in kernel.variants if v.backend != "triton" for launch in v.launches):
            if any(p.name == "G" for p in launch.params) or launch.constexprs.get("NORM"):
                c = launch.constexprs
                readers.setdefault((launch.function, c.get("ACT"), c.get("PDL"), c.get("PLANES")), launch)
    return readers


def generated(launch) -> str:
    """The launch's generated code for sm_90a: TileLang's CUDA, CuTe DSL's PTX."""
    if launch.backend == "cute":
        from pegainfer.backends.cute.compiler import compile_to_files
        return compile_to_files(launch, 90)[0]
    from pegainfer.backends.tilelang.compiler import lower
    return lower(launch, 90)[1].kernel_source


def offset_adds(launch, code: str) -> int:
    """How many times the code adds the float 1.0 to a value where the norm's weight becomes float32: TileLang
    broadcasts the constant into a variable first; the PTX adds it as an immediate (0f3F800000)."""
    if launch.backend == "cute":
        return len(re.findall(r"add\.f32\s+%r\d+, %r\d+, 0f3F800000;", code))
    return len(re.findall(r"float broadcast_var\w* = 0x1p\+0f", code))


@pytest.fixture(scope="module")
def offset_readers():
    """The launches reading G of Gemma 3 (at a width both backends take: its QKV gives the single GEMM's tiles)
    and Qwen3.5-0.8B (SiLU x up's), whose norms before their GEMMs scale by 1 + weight, and Gemma 3's FP8
    quantizing launch (--quantization fp8; Qwen3.5's FP8 weights are not loaded yet)."""
    width = {"hidden_size": 1024}
    fp8 = norm_weight_readers("gemma-3-1b", "fp8", width)
    return norm_weight_readers("gemma-3-1b", None, width) | norm_weight_readers("qwen3.5-0.8b") \
        | {key: launch for key, launch in fp8.items() if key[0] == "quantize_rows"}


def test_a_norm_that_scales_by_one_plus_weight_adds_the_offset_to_g_in_the_generated_code(offset_readers):
    """Each native launch reading G of a 1 + weight norm (NORM_OFFSET=1.0) adds 1.0 to G once G is float32 (the
    8 values of a CuTe GEMV's load at least); the same launch at NORM_OFFSET=0.0, as Qwen3's are planned, has no
    such add, and Qwen3's own launches have none."""
    assert {key[:2] for key in offset_readers if key[0] in ("decode_normed", "gemv")} == {
        ("decode_normed", 0), ("decode_normed", 1), ("gemv", 0), ("gemv", 1)}
    assert {key[2] for key in offset_readers if key[0] == "quantize_rows"} == {False, True}
    assert {key[2:] for key in offset_readers if key[0] == "add_rms_norm"} == {(None, None), (True, 4)}
    for key, launch in offset_readers.items():
        assert launch.constexprs["NORM_OFFSET"] == 1.0, key
        plain = replace(launch, constexprs=launch.constexprs | {"NORM_OFFSET": 0.0})
        with_offset, without = offset_adds(launch, generated(launch)), offset_adds(plain, generated(plain))
        assert with_offset >= (8 if launch.backend == "cute" else 1) and without == 0, (key, with_offset, without)
    for key, launch in norm_weight_readers("qwen3-0.6b").items():
        assert launch.constexprs["NORM_OFFSET"] == 0.0, key
        assert offset_adds(launch, generated(launch)) == 0, key


def test_the_launches_with_a_norm_offset_compile_for_sm90a(offset_readers):
    """The offset launches build to cubins with no spills (TileLang's ptxas report; CuTe's local memory), each
    within the registers of the CTAs it asks an SM to hold."""
    todo = {(90, "/".join(map(str, key))): launch for key, launch in offset_readers.items()}
    for (_, key), native in compile_many(todo, 2, None):
        assert native.cubin[:4] == b"\x7fELF", key
        assert native.resources.get("spill_stores", 0) == 0 and native.resources.get("local", 0) == 0, key
        blocks = todo[(90, key)].constexprs.get("MIN_BLOCKS", 1)
        assert native.resources["registers"] * native.threads * blocks <= 65536, (key, native.resources)
