"""Tricky model outputs and what ds4's graders read from them: `dwarfstar eval --self-test-extractors`
runs this table, and the test suite runs it too. Each expected pick was worked out by hand, as a
person reads the reply (for choices) or from the rules in graders.py, not produced by running them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExtractorCase:
    name: str
    kind: str
    output: str
    expected: str  # the question's answer
    picked: str  # what the grader must read
    passed: bool
    n_choices: int = 4


CASES: tuple[ExtractorCase, ...] = (
    # -- multiple choice: 30 replies graded by hand as a person reads them (issue 35), ds4's fallback to
    # any standalone letter dropped: prose that holds the article "a" is no answer
    ExtractorCase(
        "choice italian prose with a",
        "choice",
        "</think>perchè non avrebbe potuto\na farne a un altro",
        "A",
        "?",
        False,
    ),
    ExtractorCase(
        "choice italian sentence opens with A", "choice", "</think>A mio parere non si può dire.", "A", "?", False
    ),
    ExtractorCase(
        "choice italian articles", "choice", "</think>Andò a casa a piedi, e a lungo pensò a lei.", "A", "?", False
    ),
    ExtractorCase("choice italian a causa", "choice", "</think>Non lo so: forse è a causa del tempo.", "A", "?", False),
    ExtractorCase(
        "choice english prose with a", "choice", "</think>This is a hard question and I am not sure.", "A", "?", False
    ),
    ExtractorCase(
        "choice english sentence opens with A",
        "choice",
        "</think>A novel like this was written by a poet.",
        "A",
        "?",
        False,
    ),
    ExtractorCase("choice label then the article", "choice", "</think>The answer is a guess at best.", "A", "?", False),
    ExtractorCase(
        "choice letter inside a word after the label", "choice", "</think>Answer: Both are wrong", "B", "?", False
    ),
    ExtractorCase(
        "choice verdict in prose only", "choice", "</think>Leopardi? No. Foscolo? No. It must be D.", "D", "?", False
    ),
    ExtractorCase("choice nothing", "choice", "</think>no idea", "A", "?", False),
    ExtractorCase("choice plain", "choice", "</think>Answer: B", "B", "B", True),
    ExtractorCase("choice after reasons", "choice", "</think>It is by Manzoni.\nAnswer: B", "B", "B", True),
    ExtractorCase("choice no think close", "choice", "I think it is C.\nAnswer: C", "C", "C", True),
    ExtractorCase("choice only reasoning counts nothing", "choice", "Answer: D</think>", "D", "?", False),
    ExtractorCase("choice reasoning answer ignored", "choice", "Answer: A</think>\nAnswer: C", "A", "C", False),
    ExtractorCase("choice lower-case label and letter", "choice", "</think>answer - (d)", "D", "D", True),
    ExtractorCase("choice upper-case label", "choice", "</think>FINAL ANSWER: A", "A", "A", True),
    ExtractorCase("choice lower-case a after the label", "choice", "</think>Answer: a", "A", "A", True),
    ExtractorCase("choice bold label and letter", "choice", "</think>**Answer:** **B**", "B", "B", True),
    ExtractorCase("choice letter and its text", "choice", "</think>Answer: B. Alessandro Manzoni", "B", "B", True),
    ExtractorCase("choice the final line wins", "choice", "</think>Answer: B\nAnswer: C", "C", "C", True),
    ExtractorCase("choice beyond the last choice", "choice", "</think>Answer: E", "B", "?", False),
    ExtractorCase("choice five options allow E", "choice", "</think>Answer: E", "E", "E", True, 5),
    ExtractorCase("choice italian label", "choice", "</think>Secondo me la risposta è B.", "B", "B", True),
    ExtractorCase("choice boxed", "choice", "</think>Therefore the answer is $\\boxed{C}$.", "C", "C", True),
    ExtractorCase(
        "choice boxed text", "choice", "</think>Quindi a conti fatti: $$\\boxed{\\text{A}}$$", "A", "A", True
    ),
    ExtractorCase(
        "choice bold in a sentence", "choice", "</think>Manzoni wrote it, so I choose **B**.", "B", "B", True
    ),
    ExtractorCase("choice lone letter", "choice", "</think>After checking each option:\n\nC", "C", "C", True),
    ExtractorCase("choice lone lower-case reply", "choice", "</think>a", "A", "A", True),
    ExtractorCase("choice inside code after answer", "choice", "</think>Answer:\n```\nB\n```", "B", "B", True),
    # -- integers ------------------------------------------------------------------------------------
    ExtractorCase("integer plain", "integer", "</think>Answer: 70", "70", "70", True),
    ExtractorCase("integer leading zeros", "integer", "</think>Answer: 007", "7", "7", True),
    ExtractorCase("integer all zeros", "integer", "</think>Answer: 000", "0", "0", True),
    ExtractorCase("integer expected with zeros", "integer", "</think>Answer: 42", "042", "42", True),
    ExtractorCase("integer no think close", "integer", "12 then 30\nanswer = 30", "30", "30", True),
    ExtractorCase("integer reasoning ignored", "integer", "Answer: 5</think>the total is 9", "5", "9", False),
    ExtractorCase("integer no label: last number", "integer", "</think>3 apples and 4 pears: 7", "7", "7", True),
    ExtractorCase("integer several answers", "integer", "</think>Answer: 12\nAnswer: 13", "13", "12", False),
    ExtractorCase("integer in code", "integer", "</think>Answer:\n```\nprint(204)\n```", "204", "204", True),
    ExtractorCase("integer LaTeX box", "integer", "</think>**Answer:** $\\boxed{588}$", "588", "588", True),
    ExtractorCase(
        "integer window falls back to last", "integer", "</think>Answer" + " " * 170 + "5 or 6", "6", "6", True
    ),
    ExtractorCase("integer nothing", "integer", "</think>I cannot say.", "1", "?", False),
    # -- C line specs ----------------------------------------------------------------------------------
    ExtractorCase("lines single", "lines", "</think>Answer: 18", "17-20", "18", True),
    ExtractorCase("lines outside range", "lines", "</think>Answer: 21", "17-20", "21", False),
    ExtractorCase("lines list inside set", "lines", "</think>Answer: 9, 15", "9,15", "9,15", True),
    ExtractorCase("lines words between", "lines", "</think>Answer: line 9 and 15", "9,15", "9,15", True),
    ExtractorCase("lines spaces only", "lines", "</think>Answer: 9 15", "9,15", "9,15", True),
    ExtractorCase("lines one outside fails", "lines", "</think>Answer: 9, 16", "9,15", "9,16", False),
    ExtractorCase("lines range answer", "lines", "</think>Answer: 18 - 19", "17-20", "18-19", True),
    ExtractorCase("lines range too wide", "lines", "</think>Answer: 16-18", "17-20", "16-18", False),
    ExtractorCase("lines safe", "lines", "</think>Answer: 0 (the code is safe)", "0", "0", True),
    ExtractorCase("lines safe expected, bug named", "lines", "</think>Answer: 12", "0", "12", False),
    ExtractorCase("lines only the answer line", "lines", "</think>Answer: 7\nsee also 8", "7", "7", True),
    ExtractorCase(
        "lines no number: integer fallback", "lines", "</think>Answer: none\nthe bug is at 33", "33", "33", True
    ),
    ExtractorCase("lines leading zeros", "lines", "</think>Answer: 017", "17", "017", True),
    ExtractorCase("lines nothing", "lines", "</think>looks fine", "0", "?", False),
)
