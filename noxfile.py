"""Developer sessions. `tests` is what CI runs (.ci/run); the others are slower or need extra builds."""

from __future__ import annotations

import glob
import os
import sys

import nox

nox.options.sessions = ["lint", "tests"]
nox.options.default_venv_backend = "venv"  # pip, not uv: uv skips the local CPU torch wheel

LLAMA_CPP = "llama-cpp-python==0.3.36"


@nox.session
def tests(session: nox.Session) -> None:
    session.install("-e", ".[dev]")
    session.run("pytest", *session.posargs)


@nox.session
def slow(session: nox.Session) -> None:
    """The tests marked slow (kept out of CI: most run the Triton interpreter for many minutes)."""
    session.install("-e", ".[dev]")
    session.run("pytest", "-m", "slow", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff>=0.15")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def parity(session: nox.Session) -> None:
    """Reference logits against llama.cpp's deepseek4 model (F32 file, F32 KV, QAT rounding off).

    The first run compiles llama.cpp from source (about 15 minutes on 2 cores).
    """
    session.install("-e", ".[dev]", LLAMA_CPP)
    session.run("python", "tools/llama_parity.py", *session.posargs)


@nox.session
def quant_compare(session: nox.Session) -> None:
    """Our Q8_0/Q4_K/Q2_K/IQ2_XXS error against llama.cpp's llama_model_quantize on the same tensors.

    Same llama-cpp-python build as `parity`; add `-- --speed 1` to time a Flash expert tensor too.
    """
    session.install("-e", ".[dev]", LLAMA_CPP)
    session.run("pytest", "-m", "llama_cpp", "tests/test_quant.py")
    session.run("python", "tools/quant_compare.py", *session.posargs)


@nox.session
def cpu_compare(session: nox.Session) -> None:
    """Our CPU backends against llama.cpp on the same file in one run (issue 38, tools/cpu_compare.py):
    read bandwidth, 512-token prefill and decode tok/s, achieved GB/s. Not in CI: it needs the `parity`
    session's llama-cpp-python build and a 9.5 GB file, the Flash-shaped 4-layer q2 one it writes to
    build/cpu/flash4.gguf unless `--model FILE` is given (`-- --backends reference --decode 8`).
    """
    session.install("-e", ".[dev]", LLAMA_CPP)
    args = list(session.posargs)
    if "--model" not in args and not any(a.startswith("--model=") for a in args):
        model = "build/cpu/flash4.gguf"
        if not os.path.exists(model):
            synth = ("--preset", "flash-shaped", "--layout", "ds4", "--layers", "4")
            session.run("python", "-m", "dwarfstar", "synth", model, *synth)
        args = ["--model", model, *args]
    session.run("python", "tools/cpu_compare.py", *args)


CLIENTS = ("@anthropic-ai/claude-code@2.1.332", "@openai/codex@0.171.0", "opencode-ai@1.18.33")


@nox.session(venv_backend="none")
def clients(session: nox.Session) -> None:
    """Claude Code, Codex and opencode (pinned, from npm into build/clients) against a loopback server.

    Runs in the Python nox runs from (the project's dev install, `.venv/bin/nox -s clients`), so the
    only downloads are the npm packages. Not in CI: the npm install is slow. Each client runs a plain
    turn, a tool round trip, an attached image and a 4-turn session (tools/clients_check.py);
    `-- --servers bundled` runs them against the bundled model instead of the scripted server
    (`scripted bundled`: both), and `--json FILE` keeps the figures. Exit status 1 if any scenario
    fails.
    """
    folder = "build/clients"
    # --ignore-scripts: the packages ship their platform binaries as optional dependencies, so
    # nothing needs to run at install time (and nothing downloads from outside the registry)
    session.run(
        "npm", "install", "--prefix", folder, "--no-audit", "--no-fund", "--ignore-scripts", *CLIENTS, external=True
    )
    # but Claude Code's and opencode's own bins are stubs until their postinstalls link the platform
    # binary in (a local link or copy, no download): run just those two
    for postinstall in ("@anthropic-ai/claude-code/install.cjs", "opencode-ai/postinstall.mjs"):
        session.run("node", f"{folder}/node_modules/{postinstall}", external=True)
    session.run(sys.executable, "tools/clients_check.py", "--clients", folder, *session.posargs, external=True)


@nox.session(venv_backend="none")
def reliability(session: nox.Session) -> None:
    """Fuzzing (10,000 generated inputs per target: GGUF reader, KV-file loader, DSML parser, the
    request bodies of every API) and the load and kill tests; prints each target's tally.

    Runs in the Python nox runs from (`.venv/bin/nox -s reliability`); `-- -k gguf` picks targets.
    The suite runs the same tests with a few dozen inputs each.
    """
    for name, value in (
        ("DWARFSTAR_FUZZ_EXAMPLES", "10000"),
        ("DWARFSTAR_SOAK_CLIENTS", "10"),
        ("DWARFSTAR_SOAK_REQUESTS", "50"),
        ("DWARFSTAR_KILLS", "50"),
    ):
        session.env[name] = os.environ.get(name, value)
    session.run(sys.executable, "-m", "pytest", "tests/reliability", "-s", "-q", "-m", "", *session.posargs)


@nox.session(venv_backend="none")
def stress(session: nox.Session) -> None:
    """Mixed concurrent traffic through the server on the bundled model, each completed reply compared
    with the request run alone and every token prefix's logits bit for bit (tests/serving/stress.py):
    20 seeds on the reference backend, then a small seed on Triton in its interpreter (slow; its decode
    steps are bit-invariant but its prefill only within float rounding, so only its replies count).
    The suite runs one small seed.

    Runs in the Python nox runs from (`.venv/bin/nox -s stress`); `-- --seeds 7 --clients 6` runs
    those arguments alone, as a report's rerun command does.
    """
    script = "tests/serving/stress.py"
    session.run(sys.executable, script, *(session.posargs or ["--seeds", "0-19"]), external=True)
    if not session.posargs:
        small = ["--backend", "triton", "--seeds", "0", "--clients", "2", "--requests", "1", "--max-tokens", "4"]
        small.append("--no-prefix")  # a decode step takes the interpreter about a minute
        session.run(sys.executable, script, *small, env={"TRITON_INTERPRET": "1"}, external=True)


@nox.session(venv_backend="none")
def twin_k(session: nox.Session) -> None:
    """The nano model's 256-wide twin (`tools/train_nano.py --twin-k`, under build/twin-k) and its
    quantization table: perplexity, KL and top-1 against its f32 source for q8, q4, q2-q4 and q2, each
    with and without an imatrix. Not in CI: training takes about as long as the bundled model's.

    Runs in the Python nox runs from (`.venv/bin/nox -s twin_k`); `-- --resume` continues training.
    """
    build = "build/twin-k"
    py = (sys.executable,)
    ds = (sys.executable, "-m", "dwarfstar")
    f32, prompts = f"{build}/nano-twin-f32.gguf", f"{build}/prompts"
    session.run(*py, "tools/train_nano.py", "--twin-k", "--f32-out", f32, *session.posargs, external=True)
    session.run(*py, "tools/nano_prompts.py", prompts, external=True)
    imatrix = f"{build}/imatrix.dat"
    session.run(*ds, "imatrix", "-m", f32, "--prompts", f"{prompts}/calibration.jsonl", "-o", imatrix, external=True)
    for recipe in ("q8", "q4", "q2-q4", "q2"):
        for calibration in ((), ("--imatrix", imatrix)):
            out = f"{build}/nano-twin-{recipe}{'-imatrix' if calibration else ''}.gguf"
            session.run(*ds, "quantize", f32, out, "--recipe", recipe, *calibration, external=True)
            session.run(*ds, "quality", f32, out, "--prompts", f"{prompts}/heldout.jsonl", external=True)


# The GPU check's H200 image's versions of what the check imports (tools/gpu_image/packages.txt lists
# the image; the unpinned ones' versions there are not known here: the check logs its pip list).
GPU_IMAGE = (
    "triton==3.6.0",
    "huggingface_hub==1.33.0",
    "transformers==5.17.0",
    "safetensors==0.8.0",
    "tokenizers==0.23.2",
    "numpy==2.4.6",  # the image has 2.5.2, which needs Python 3.12; this machine has only 3.11
    "typer<0.29",  # 0.29 needs pydantic, which the image lacks: its typer is older
    "rich",
    "httpx",
    "regex",
    "pyyaml",
    "tqdm",
    "requests",
    "pytest",
    "pytest-xdist",
    "pytest-timeout",
    "hypothesis",
)


@nox.session
def gpu_image(session: nox.Session) -> None:
    """The GPU check on the H200 image's packages, here: a venv with their versions (torch: the local CPU
    2.13.0, as the image's 2.11.0+cu130 is gigabytes) and the wheels of tools/gpu_wheels.sh, nothing
    else; every dwarfstar module imported (tools/gpu_image/check.py), the dry GPU check, and every
    kernel compiled for sm_90 by triton 3.6 (`aot_check --targets cuda:90`).

    Python is the one nox runs from (3.11 here; the image has 3.12.3)."""
    session.install("torch==2.13.0", *GPU_IMAGE)
    session.run("bash", "tools/gpu_wheels.sh", external=True)
    session.install("--no-deps", "--no-index", *glob.glob(".whl/*.whl"))
    env = {"PYTHONPATH": os.getcwd(), "TRITON_INTERPRET": "0"}
    session.run("python", "tools/gpu_image/check.py", env=env)
    dry = {"GPU_CHECK_DRY": "1", "PYTHON": "python", "TRITON_CACHE_DIR": "build/gpu_image/triton-cache"}
    session.run("bash", "tools/gpu_check.sh", "build/gpu_image/dry", env=env | dry, external=True)
    session.run("python", "-m", "dwarfstar.backends.triton.aot_check", "--targets", "cuda:90", env=env)
