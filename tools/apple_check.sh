#!/usr/bin/env bash
# The MLX backend's checks on an Apple silicon Mac, which no Linux machine can run:
#   1. tests/mlx with the real Metal kernels (their tests must run, not skip), and
#   2. decode benches: the tiny model against the reference backend, and a synthetic flash-shaped
#      q2 model (Flash's dimensions, 2 layers, IQ2_XXS/Q2_K experts) read in place by the kernels,
#      with its tok/s as a fraction of the chip's bandwidth limit.
#
# Usage: tools/apple_check.sh OUTDIR
#   OUTDIR/system.txt            chip, macOS and MLX versions
#   OUTDIR/tests.txt             pytest output
#   OUTDIR/tiny_decode.json      MLX vs reference decode tok/s, parity
#   OUTDIR/gates.txt             `dwarfstar test` gates (bundled fixtures; a real GGUF when present)
#   OUTDIR/flash_q2_decode.json  MLX decode tok/s, GB/s, fraction of the bandwidth limit
#   OUTDIR/streaming.txt         expert streaming: MLX streamed logits equal resident (tests), and the
#                                flash-q2 model run resident and with --ssd-streaming (a 1 GB cache):
#                                the same greedy tokens, and the streamed run's expert line
#   OUTDIR/flash-q2.gguf         the synthetic model (about 6 GB; reused when present)
# Environment: PYTHON (default .venv/bin/python, else python3), FLASH_TOKENS (default 64).
set -uo pipefail

out=${1:?usage: tools/apple_check.sh OUTDIR}
cd "$(dirname "$0")/.." || exit 2
mkdir -p "$out"
if [ -n "${PYTHON:-}" ]; then py=$PYTHON; elif [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi

fail() { echo "apple_check: $*" >&2; exit 1; }

[ "$(uname -s)" = Darwin ] && [ "$(uname -m)" = arm64 ] || fail "needs an Apple silicon Mac"
"$py" -c 'import sys, mlx.core as mx; sys.exit(not mx.metal.is_available())' \
    || fail "MLX with Metal is not available to $py (pip install -e '.[dev]' mlx)"

{
    sysctl -n machdep.cpu.brand_string
    sw_vers
    "$py" -c 'import mlx.core as mx; print("mlx", mx.__version__)'
} > "$out/system.txt"
cat "$out/system.txt"

echo "== tests/mlx (real Metal kernels)"
"$py" -m pytest tests/mlx -q -rs -p no:cacheprovider 2>&1 | tee "$out/tests.txt"
status=${PIPESTATUS[0]}
grep -q "no Metal device" "$out/tests.txt" && fail "the Metal kernel tests were skipped"
[ "$status" -eq 0 ] || fail "tests failed (exit $status), see $out/tests.txt"

echo "== tiny model: MLX against the reference backend"
"$py" -m dwarfstar bench mlx --json > "$out/tiny_decode.json" || fail "tiny bench failed"

echo "== gates: the bundled model's fixtures on MLX; ds4's gates on a real GGUF when one is here"
"$py" -m dwarfstar test vectors --vector-file tests/data/gates/nano.vec --backend mlx > "$out/gates.txt" 2>&1 \
    || fail "nano vectors on MLX failed, see $out/gates.txt"
real=${DS4_TEST_MODEL:-ds4flash.gguf}
if [ -f "$real" ]; then
    vec=${DS4_TEST_VECTOR_FILE:-../shared/fixtures/ds4/test-vectors/official.vec}
    "$py" -m dwarfstar test vectors -m "$real" --vector-file "$vec" --backend mlx >> "$out/gates.txt" 2>&1 \
        || fail "vectors failed on $real, see $out/gates.txt"
    "$py" -m dwarfstar test tool-call -m "$real" --backend mlx >> "$out/gates.txt" 2>&1 \
        || fail "tool-call failed on $real, see $out/gates.txt"
fi

echo "== synthetic flash-shaped q2 model"
model="$out/flash-q2.gguf"
if [ ! -f "$model" ]; then
    "$py" -m dwarfstar synth "$model" --preset flash-shaped --layout ds4 || fail "could not write $model"
fi
"$py" -m dwarfstar bench mlx --model "$model" --no-reference --packing blocks \
    -n "${FLASH_TOKENS:-64}" --prompt-tokens 64 --json > "$out/flash_q2_decode.json" || fail "flash-q2 bench failed"

echo "== expert streaming"
"$py" -m pytest tests/experts/test_streaming_mlx.py -q -p no:cacheprovider > "$out/streaming.txt" 2>&1 \
    || fail "streaming tests failed, see $out/streaming.txt"
run_flash() { "$py" -m dwarfstar run -m "$model" --backend mlx --prompt-tokens 0,17,4242,99,7 -n 16 --temp 0 "$@"; }
run_flash > "$out/resident_run.tmp" 2>&1 || fail "resident flash-q2 run failed"
run_flash --ssd-streaming --ssd-streaming-cache-experts 1GB > "$out/streamed_run.tmp" 2>&1 \
    || fail "streamed flash-q2 run failed, see $out/streamed_run.tmp"
{ echo "-- resident"; cat "$out/resident_run.tmp"; echo "-- streamed"; cat "$out/streamed_run.tmp"; } >> "$out/streaming.txt"
# the reply is everything before the summary's `load` line
[ "$(sed '/^load /,$d' "$out/resident_run.tmp")" = "$(sed '/^load /,$d' "$out/streamed_run.tmp")" ] \
    || fail "streamed tokens differ from resident ones, see $out/streaming.txt"
rm -f "$out/resident_run.tmp" "$out/streamed_run.tmp"
grep "experts:" "$out/streaming.txt"

"$py" - "$out" <<'EOF'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
tiny = json.loads((out / "tiny_decode.json").read_text())
flash = json.loads((out / "flash_q2_decode.json").read_text())
print(f"tiny: mlx {tiny['mlx_tok_s']:.1f} tok/s, reference {tiny['reference_tok_s']:.1f} tok/s, "
      f"ratio {tiny['mlx_over_reference']:.2f}, max rel {tiny['max_rel']:.1e}")
spec = flash["spec_gb_s"]
print(f"flash-q2 ({flash['chip']}): {flash['mlx_tok_s']:.2f} tok/s, {flash['bytes_per_token'] / 1e9:.2f} GB/token, "
      f"{flash['achieved_gb_s']:.0f} GB/s = {flash['fraction_of_measured_read']:.0%} of a measured "
      f"{flash['measured_read_gb_s']:.0f} GB/s read"
      + ("" if spec is None else f", {flash['fraction_of_spec']:.0%} of the specified {spec:.0f} GB/s")
      + f"; bandwidth limit {flash['bandwidth_limit_tok_s']:.1f} tok/s")
EOF
