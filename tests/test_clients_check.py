"""tools/clients_check.py's own logic, without npm or a server: what counts as quoting the file, and
the scripted model's lines for every prompt the scenarios send."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "tools" / "clients_check.py"
spec = importlib.util.spec_from_file_location("clients_check", TOOL)
check = sys.modules.setdefault("clients_check", importlib.util.module_from_spec(spec))  # dataclasses look it up
spec.loader.exec_module(check)


def test_an_answer_quotes_the_file_with_enough_consecutive_words_whatever_the_case_and_punctuation():
    line = "Questo matrimonio non s'ha da fare, né domani, né mai."
    assert check.quotes('The file says: "questo matrimonio NON s’ha da fare"', line)
    assert check.quotes("... da fare né domani ...", line)  # four words, the comma aside
    assert not check.quotes("Questo matrimonio, then something else", line)
    assert not check.quotes("fare domani né mai", line)  # words of it, but not consecutive
    assert check.quotes("Questo matrimonio", "Questo matrimonio", n=4)  # a file shorter than n: all of it


def test_every_scripted_prompt_names_a_script_and_every_read_script_reads_its_scenarios_file(tmp_path):
    scripts = check.scripts(tmp_path)
    for name in check.PACKAGES:
        for scenario in check.SCENARIOS:
            prompts = check.scripted_prompts(name, scenario)
            assert len(prompts) == (len(check.SESSION_PROMPTS) if scenario == "session" else 1)
            for prompt in prompts:
                marker = re.match(r"\[\[script:(\w+)\]\] ", prompt).group(1)
                assert marker in scripts
                if check.READ_PROMPT in prompt:
                    assert str(check.workspace(tmp_path, name, scenario) / "quaderno.txt") in scripts[marker]
    # the scripted file's marker scripts an answer that quotes the file
    assert check.quotes(scripts["quote"].split("</think>")[1], check.QUADERNO)
