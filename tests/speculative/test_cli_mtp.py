"""`dwarfstar run --mtp/--mtp-draft` and `dwarfstar bench mtp` on the small model with an MTP block."""

from __future__ import annotations

import re

from conftest import PROMPT
from typer.testing import CliRunner

from dwarfstar.cli import _register_commands, app
from dwarfstar.sampling import GREEDY
from dwarfstar.session.session import Session

_register_commands()
IDS = ",".join(map(str, PROMPT))


def cli(*args: str):
    return CliRunner().invoke(app, list(args))


def test_run_speculative_prints_the_plain_greedy_text(mtp_files, engines):
    engine = engines("reference")
    session = Session(engine.backend, ctx=1024)
    session.prefill(PROMPT)
    want = engine.tokenizer.decode(list(session.generate(24, GREEDY, [engine.model.args.eos_token_id])))
    for extra in (["--mtp-draft", "3"], ["--mtp", str(mtp_files["ds4"]), "--mtp-align", "same"]):
        done = cli("run", "-m", str(mtp_files["nextn"]), "--backend", "reference", "--prompt-tokens", IDS,
                   "--temp", "0", "-n", "24", "-c", "1024", *extra)  # fmt: skip
        assert done.exit_code == 0, done.output
        assert done.stdout == want + "\n"
        assert re.search(r"mtp N=\d (next|same): \d+ steps, [\d.]+ accepted per step", done.stderr)


def test_run_errors(mtp_files):
    base = ["run", "-m", str(mtp_files["plain"]), "--backend", "reference", "--temp", "0", "-n", "4"]
    cases = [
        ([*base, "--prompt-tokens", IDS, "--mtp-draft", "2"], "has no MTP block"),
        ([*base, "--prompt-tokens", IDS, "--mtp", str(mtp_files["other"])], "MTP block of another model"),
        ([*base, "--prompt-tokens", IDS, "--mtp", str(mtp_files["ds4"]), "--mtp-draft", "0"], "--mtp-draft must be"),
        ([*base, "--mtp-draft", "2"], "needs a one-shot prompt"),
    ]
    for args, message in cases:
        done = cli(*args)
        assert done.exit_code != 0
        assert message in str(done.exception) + done.output, (args, done.output)


def test_bench_mtp_reports_every_count_and_alignment(mtp_files):
    done = cli("bench", "mtp", "--drafts", "1,2", "-m", str(mtp_files["nextn"]), "--backend", "reference", "-n", "12")
    assert done.exit_code == 0, done.output
    rows = re.findall(r"^mtp (\d) (next|same)\s+.*\s(yes|NO)$", done.stdout, flags=re.M)
    assert [(n, a) for n, a, _ in rows] == [("1", "next"), ("1", "same"), ("2", "next"), ("2", "same")]
    assert all(same == "yes" for _, _, same in rows)


def test_bundled_model_speculates_with_its_bundled_block():
    """The bundled model has no in-file block; --mtp-draft alone uses dwarfstar/data/nano-mtp.gguf,
    and the reply is the plain greedy one."""
    base = ["run", "--backend", "reference", "-p", "Quel ramo del lago di Como", "--nothink", "--temp", "0", "-n", "16"]
    plain, spec = cli(*base), cli(*base, "--mtp-draft", "2")
    assert plain.exit_code == 0 and spec.exit_code == 0, spec.output
    assert spec.stdout == plain.stdout
    accepted = float(re.search(r"([\d.]+) accepted per step", spec.stderr).group(1))
    assert accepted > 0  # the trained block's drafts are accepted


def test_serve_errors(mtp_files):
    """serve refuses bad MTP settings before it listens: a draft count out of range, no MTP block."""
    base = ["serve", "-m", str(mtp_files["plain"]), "--backend", "reference", "-c", "1024", "--port", "0"]
    cases = [
        ([*base, "--mtp-draft", "0"], "--mtp-draft must be"),
        ([*base, "--mtp-draft", "2", "--mtp-align", "sideways"], "unknown MTP alignment"),
        ([*base, "--mtp-draft", "2"], "has no MTP block"),
        ([*base, "--mtp", str(mtp_files["other"])], "MTP block of another model"),
    ]
    for args, message in cases:
        done = cli(*args)
        assert done.exit_code != 0
        assert message in str(done.exception) + done.output, (args, done.output)
