# Sourced by the scripts that run on the GPU machine, from the checkout's root: the checkout importable as
# `pegainfer` (the repository root is the package; PEGAINFER_SRC=DIR: another tree instead, such as .gpu/src, a
# `git archive` of one commit, so that a run measures that commit and not a working tree others are editing),
# unbuffered output, the cubin cache (PEGAINFER_CACHE, by default .gpu/aot_cache), $OUT, and `pg` for the CLI.
# `keep_work DIR TARBALL` makes DIR ($WORK) and packs it into $OUT/TARBALL when the script exits: the device tool
# brings back 8 files at most.
mkdir -p /tmp/pkg && ln -sfn "$(realpath "${PEGAINFER_SRC:-$PWD}")" /tmp/pkg/pegainfer
export PYTHONPATH=/tmp/pkg PYTHONUNBUFFERED=1 PEGAINFER_CACHE="${PEGAINFER_CACHE:-$PWD/.gpu/aot_cache}"
export OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
pg() { python3 -m pegainfer.cli "$@"; }
keep_work() {
    export WORK=$1
    mkdir -p "$WORK"
    trap "tar czf '$OUT/$2' -C '$WORK' . 2>/dev/null" EXIT
}
