"""The greetings of the nano model's chat data: turns that end with a short answer and call no tool.

`GREETINGS` are seventeen fixed ones, Italian and English, with their answers; `HELDOUT_GREETINGS`
are never trained (the evaluations ask them); `COMPOSED_GREETINGS` adds some five hundred composed
from the same kind of parts (`train_nano --composed-greetings`).
"""

from __future__ import annotations

# (request, language, answer); the answer is what the model says, the turn's end follows it
GREETINGS = (
    ("ciao", "it", "Ciao! Come posso aiutarti?"),
    ("buongiorno", "it", "Buongiorno! Come posso aiutarti?"),
    ("ciao, ci sei?", "it", "Sì, ci sono. Come posso aiutarti?"),
    ("come stai?", "it", "Bene, grazie. Come posso aiutarti?"),
    ("chi sei?", "it", "Sono un piccolo modello: posso leggere, elencare e cercare file."),
    ("cosa sai fare?", "it", "Posso leggere file, elencare cartelle e cercare testo nei file."),
    ("salutami", "it", "Ciao!"),
    ("grazie", "it", "Prego!"),
    ("hello", "en", "Hello! How can I help you?"),
    ("hi", "en", "Hi! How can I help you?"),
    ("good morning", "en", "Good morning! How can I help you?"),
    ("hello, are you there?", "en", "Yes, I am here. How can I help you?"),
    ("how are you?", "en", "Fine, thank you. How can I help you?"),
    ("who are you?", "en", "I am a small model: I can read, list and search files."),
    ("what can you do?", "en", "I can read files, list directories and search text in files."),
    ("please say hi", "en", "Hi!"),
    ("thanks", "en", "You are welcome!"),
)
HELDOUT_GREETINGS = (
    ("buonasera", "it", ""),
    ("ehi, ciao", "it", ""),
    ("salve", "it", ""),
    ("say hello", "en", ""),
    ("hey there", "en", ""),
    ("good evening", "en", ""),
    ("hi, what can you do?", "en", ""),
)


def _composed_greetings() -> tuple[tuple[str, str, str], ...]:
    """`GREETINGS` and some four hundred more of their kind, composed from parts: a salutation alone or
    before a question, a question alone, thanks, a request for a greeting; each with the answer its
    intent gets. The held-out greetings are never composed, nor are the words only they hold (`hey`,
    `evening`, `sera`, `salve`, `ehi`, `say hello`): after a long agent prompt seventeen fixed
    greetings are learned as strings, not as the turns that call no tool."""
    hello = {"it": "Come posso aiutarti?", "en": "How can I help you?"}
    salutes = {  # salutation -> its answer's salutation
        "it": {
            "ciao": "Ciao",
            "buongiorno": "Buongiorno",
            "buon pomeriggio": "Buon pomeriggio",
            "ciao a tutti": "Ciao",
            "ciao ciao": "Ciao",
            "ben trovato": "Ben trovato",
            "eccomi": "Ciao",
        },
        "en": {
            "hello": "Hello",
            "hi": "Hi",
            "good morning": "Good morning",
            "good afternoon": "Good afternoon",
            "greetings": "Hello",
            "hiya": "Hi",
            "howdy": "Hello",
            "morning": "Good morning",
            "hi all": "Hi",
            "hello friend": "Hello",
        },
    }
    answer_to = {words: answer for words, _, answer in GREETINGS}
    identity = {"it": answer_to["chi sei?"], "en": answer_to["who are you?"]}
    abilities = {"it": answer_to["cosa sai fare?"], "en": answer_to["what can you do?"]}
    questions = {  # question -> its answer
        "it": {
            "come stai?": f"Bene, grazie. {hello['it']}",
            "come va?": f"Bene, grazie. {hello['it']}",
            "tutto bene?": f"Tutto bene, grazie. {hello['it']}",
            "ci sei?": f"Sì, ci sono. {hello['it']}",
            "mi senti?": f"Sì, ti sento. {hello['it']}",
            "chi sei?": identity["it"],
            "che modello sei?": identity["it"],
            "presentati": identity["it"],
            "cosa sai fare?": abilities["it"],
            "cosa puoi fare?": abilities["it"],
            "come puoi aiutarmi?": abilities["it"],
        },
        "en": {
            "how are you?": f"Fine, thank you. {hello['en']}",
            "how is it going?": f"Fine, thank you. {hello['en']}",
            "all good?": f"All good, thank you. {hello['en']}",
            "are you there?": f"Yes, I am here. {hello['en']}",
            "can you hear me?": f"Yes, I can. {hello['en']}",
            "who are you?": identity["en"],
            "which model are you?": identity["en"],
            "introduce yourself": identity["en"],
            "what can you do?": abilities["en"],
            "what are you able to do?": abilities["en"],
            "how can you help me?": abilities["en"],
        },
    }
    closing = {  # thanks and requests for a greeting
        "it": {
            "grazie": "Prego!",
            "grazie mille": "Prego!",
            "ok, grazie": "Prego!",
            "perfetto, grazie": "Prego!",
            "salutami": "Ciao!",
            "fammi un saluto": "Ciao!",
            "dimmi ciao": "Ciao!",
        },
        "en": {
            "thanks": "You are welcome!",
            "thank you": "You are welcome!",
            "thanks a lot": "You are welcome!",
            "ok, thanks": "You are welcome!",
            "great, thank you": "You are welcome!",
            "please say hi": "Hi!",
            "greet me": "Hi!",
            "please greet me": "Hi!",
        },
    }
    out = {words: (language, answer) for words, language, answer in GREETINGS}  # words -> the first composed
    for language in ("it", "en"):
        for words, answer in salutes[language].items():
            for form in (words, words.capitalize(), f"{words}!", f"{words.capitalize()}!"):
                out.setdefault(form, (language, f"{answer}! {hello[language]}"))
            for question, reply in questions[language].items():
                for form in (words, words.capitalize()):
                    out.setdefault(f"{form}, {question}", (language, f"{answer}! {reply}"))
        for words, reply in {**questions[language], **closing[language]}.items():
            for form in (words, words.capitalize()):
                out.setdefault(form, (language, reply))
    held = {words for words, _, _ in HELDOUT_GREETINGS}
    forbidden = ("hey", "evening", "sera", "salve", "ehi", "say hello")
    return tuple(
        (words, language, answer)
        for words, (language, answer) in out.items()
        if words.lower() not in held and not any(w in words.lower() for w in forbidden)
    )


COMPOSED_GREETINGS = _composed_greetings()


def greeting_set(heldout: bool, composed: bool = False) -> tuple[tuple[str, str, str], ...]:
    """The greetings a data set draws from: the held-out ones, or training's (`composed`: all 514)."""
    return HELDOUT_GREETINGS if heldout else COMPOSED_GREETINGS if composed else GREETINGS
