"""The greetings the nano model trains on (dwarfstar/train/greetings.py): the composed ones hold the
fixed seventeen, never a held-out greeting nor a word only those hold, answer each part's intent, and
come out in the same order in every process (training draws them by index)."""

from __future__ import annotations

import subprocess
import sys

from dwarfstar.train.greetings import COMPOSED_GREETINGS, GREETINGS, HELDOUT_GREETINGS


def test_composed_greetings_extend_the_fixed_ones_and_leave_the_heldout_ones_out() -> None:
    words = [w for w, _, _ in COMPOSED_GREETINGS]
    assert set(GREETINGS) <= set(COMPOSED_GREETINGS) and len(set(words)) == len(words) >= 400
    held = {w for w, _, _ in HELDOUT_GREETINGS}
    for w in words:
        plain = w.lower().rstrip("!")
        assert plain not in held, w
        assert not any(only in plain for only in ("hey", "evening", "sera", "salve", "ehi", "say hello")), w
    assert {language for _, language, _ in COMPOSED_GREETINGS} == {"it", "en"}


def test_a_composed_greeting_answers_its_salutation_then_its_question() -> None:
    answers = {w: (language, answer) for w, language, answer in COMPOSED_GREETINGS}
    assert answers["Hiya, what are you able to do?"] == (
        "en",
        "Hi! I can read files, list directories and search text in files.",
    )
    assert answers["buon pomeriggio, come va?"] == ("it", "Buon pomeriggio! Bene, grazie. Come posso aiutarti?")
    assert answers["Grazie mille"] == ("it", "Prego!")
    assert answers["ciao, ci sei?"] == ("it", "Sì, ci sono. Come posso aiutarti?")  # the fixed one's answer kept


def test_the_composed_order_is_the_same_under_any_hash_seed() -> None:
    code = "from dwarfstar.train.greetings import COMPOSED_GREETINGS as C; print(repr(C))"
    seen = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={"PYTHONHASHSEED": seed, "PATH": ""},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in ("1", "2")
    }
    assert len(seen) == 1 and repr(COMPOSED_GREETINGS) + "\n" in seen
