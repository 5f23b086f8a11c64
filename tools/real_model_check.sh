#!/usr/bin/env bash
# tools/real_model_check.sh GGUF [OUTDIR]: every `dwarfstar test` gate and `dwarfstar eval` on real
# DeepSeek V4 weights, into one report (OUTDIR/report.txt, default build/real-check), for whoever first
# has the weights and the hardware. Each step's full output goes to OUTDIR/<step>.log.
#
# Environment (ds4's names where ds4 has one):
#   BACKEND               compute backend (default auto)
#   DS4_TEST_VECTOR_FILE  ds4's tests/test-vectors/official.vec (default ../shared/fixtures/ds4/...)
#   DS4_TEST_LONG_PROMPT  ds4's tests/long_context_story_prompt.txt (default ../shared/fixtures/text/...)
#   QUALITY_MANIFEST      ds4's quality-testing data/manifest.tsv of official continuations, or
#   QUALITY_REFERENCE     another GGUF whose greedy continuations are the targets (q4 for a q2, say);
#                         with neither, the quality gate is skipped
#   QUALITY_LIMIT         score only the first N quality prompts (default: all 100)
#   DS4_EVAL_C            ds4's ds4_eval.c: its 92 questions are imported and run too
#   EVAL_TOKENS           tokens per eval question (default 16000, ds4-eval's)
#   EVAL_ARGS             more `dwarfstar eval` options (budgets below 1024 tokens need
#                         --hard-limit-reply-budget and --soft-limit-reply-budget)
set -u

GGUF=${1:?usage: tools/real_model_check.sh GGUF [OUTDIR]}
OUT=${2:-build/real-check}
cd "$(dirname "$0")/.." || exit 2
mkdir -p "$OUT"
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON; elif [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
DS=("$PY" -m dwarfstar)
BACKEND=${BACKEND:-auto}
VEC=${DS4_TEST_VECTOR_FILE:-../shared/fixtures/ds4/test-vectors/official.vec}
LONG=${DS4_TEST_LONG_PROMPT:-../shared/fixtures/text/long_context_story_prompt.txt}
REPORT=$OUT/report.txt
QLIMIT=()
[ -n "${QUALITY_LIMIT:-}" ] && QLIMIT=(--limit "$QUALITY_LIMIT")
read -r -a EVAL_EXTRA <<<"${EVAL_ARGS:-}"
FAILED=0

# step NAME CMD...: runs CMD with its output in OUTDIR/NAME.log; the verdict and the last lines go to the report
step() {
    local name=$1
    shift
    local t0=$(date +%s)
    "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    local verdict=PASS
    [ $rc -ne 0 ] && verdict="FAIL (exit $rc)" && FAILED=$((FAILED + 1))
    {
        echo "== $name: $verdict in $(($(date +%s) - t0))s"
        echo "   $*"
        tail -n 12 "$OUT/$name.log" | sed 's/^/   /'
        echo
    } >>"$REPORT"
    echo "$name: $verdict"
}

{
    echo "real_model_check $(date -u +%FT%TZ) at $(git rev-parse --short HEAD 2>/dev/null)"
    echo "model: $GGUF ($(du -h "$GGUF" 2>/dev/null | cut -f1)); backend: $BACKEND"
    echo
} >"$REPORT"

step vectors "${DS[@]}" test vectors -m "$GGUF" --backend "$BACKEND" --vector-file "$VEC"
step tool-call "${DS[@]}" test tool-call -m "$GGUF" --backend "$BACKEND"
step long-context "${DS[@]}" test long-context -m "$GGUF" --backend "$BACKEND" --prompt-file "$LONG"
if [ -n "${QUALITY_MANIFEST:-}" ]; then
    step quality "${DS[@]}" test quality -m "$GGUF" --backend "$BACKEND" --manifest "$QUALITY_MANIFEST" \
        "${QLIMIT[@]}" --out "$OUT/quality.tsv"
elif [ -n "${QUALITY_REFERENCE:-}" ]; then
    step quality "${DS[@]}" test quality -m "$GGUF" --backend "$BACKEND" --against "$QUALITY_REFERENCE" \
        "${QLIMIT[@]}" --out "$OUT/quality.tsv"
else
    echo "== quality: skipped (set QUALITY_MANIFEST or QUALITY_REFERENCE)" >>"$REPORT"
fi
step eval-extractors "${DS[@]}" eval --self-test-extractors
step eval "${DS[@]}" eval -m "$GGUF" --backend "$BACKEND" --plain --temp 0 --seed 1 \
    -n "${EVAL_TOKENS:-16000}" "${EVAL_EXTRA[@]}" --trace "$OUT/eval.trace"
if [ -n "${DS4_EVAL_C:-}" ]; then
    step ds4-eval-import "$PY" tools/import_ds4_eval.py "$DS4_EVAL_C" -o "$OUT/ds4_eval.jsonl"
    step ds4-eval "${DS[@]}" eval -m "$GGUF" --backend "$BACKEND" --plain --temp 0 --seed 1 \
        --questions-file "$OUT/ds4_eval.jsonl" -n "${EVAL_TOKENS:-16000}" "${EVAL_EXTRA[@]}" --trace "$OUT/ds4_eval.trace"
fi
echo "$FAILED failed steps" >>"$REPORT"
echo "report: $REPORT ($FAILED failed steps)"
[ "$FAILED" -eq 0 ]
