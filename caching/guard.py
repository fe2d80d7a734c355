"""A lexical check run on a semantic match before it is served: is it the same question?

Sentence embeddings score "capital of France?" and "capital of Germany?", "convert 5 km to
miles" and "convert 5 miles to km", or "enable 2FA" and "disable 2FA" at cosine 0.85-0.99:
the shared words dominate and one changed word barely moves the vector. On the labelled set
(docs/caching.md) no cosine threshold alone reaches a precision above 0.79. These hard
negatives share a shape that a diff of the two questions' content words shows directly:

- the numbers differ (amounts, years, sizes, roman numerals II and up), or one side is
  negated and the other is not;
- the same content words in another order ("A to B" and "B to A");
- exactly one changed slot in otherwise equal questions, one or two content words on at least
  one side: an entity, a verb, an adjective swapped for another ("undo my last git push" /
  "undo my last git commit but keep the changes").

A match with any of these is refused. True paraphrases usually reword in several places and
pass; the ones that change a single word for a synonym ("update" / "change") are refused as
well -- a miss costs one upstream call, a wrong answer costs the user.
"""

from __future__ import annotations

import difflib
import re

# Function words: they carry no question of their own. Negations, comparatives and
# prepositions of direction are deliberately not here ("not", "before", "more", "without").
_STOPWORD_TEXT = """
a an the of to in on at for from by with about into and or but if so as is are was were be been
being am do does did doing done have has had i me my mine we our ours you your yours he him his
she her hers it its they them their theirs this that these those there here what whats which who
whom whose when where why how can could should would will shall may might must please tell
explain way ways step steps any some just really
"""
STOPWORDS = frozenset(_STOPWORD_TEXT.split())
NEGATIONS = frozenset({"not", "no", "never", "without", "nor", "cannot", "nothing", "none"})
MAX_SLOT_WORDS = 2
_WORD = re.compile(r"[a-z0-9$%€£]+(?:['.,\-][a-z0-9]+)*")
_ROMAN = re.compile(r"(?:x{0,3})(?:ix|iv|v?i{0,3})")
_ROMAN_EXCLUDED = frozenset({"", "i", "v", "x"})  # a pronoun, letters, variable names


def content_words(text: str) -> list[str]:
    """Lowercased, lightly stemmed words of a question, without function words."""
    words = _WORD.findall(text.lower().replace("\u2019", "'"))
    out = []
    for word in words:
        if word in NEGATIONS or word.endswith("n't"):
            out.append("not")  # "can't", "doesn't", "never": one spelling, and kept
        elif word not in STOPWORDS and word.split("'")[0] not in STOPWORDS:
            out.append(_stem(word))
    return out


def same_question(a: str, b: str) -> bool:
    """False when the two texts differ in a way that usually changes the answer."""
    wa, wb = content_words(a), content_words(b)
    if wa == wb:
        return True
    if _numbers(wa) != _numbers(wb) or wa.count("not") != wb.count("not"):
        return False
    if sorted(wa) == sorted(wb):
        return False  # same words, another order: "5 km to miles" / "5 miles to km"
    matcher = difflib.SequenceMatcher(a=wa, b=wb, autojunk=False)
    changed = [op for op in matcher.get_opcodes() if op[0] != "equal"]
    shared = sum(block.size for block in matcher.get_matching_blocks())
    if len(changed) == 1 and shared > 0:
        _, i1, i2, j1, j2 = changed[0]
        if 1 <= min(i2 - i1, j2 - j1) <= MAX_SLOT_WORDS:
            return False  # one slot changed, the rest equal
    return True


def _numbers(words: list[str]) -> list[str]:
    found = [w.replace(",", "") for w in words if any(c.isdigit() for c in w)]
    found += [w for w in words if w not in _ROMAN_EXCLUDED and _ROMAN.fullmatch(w)]
    return sorted(found)


def _stem(word: str) -> str:
    """Just enough stemming that "databases"/"database" and "baking"/"bake" agree."""
    if len(word) > 4 and word.endswith("ies"):
        word = word[:-3] + "y"
    elif len(word) > 3 and word.endswith("s") and not word.endswith(("ss", "us", "is")):
        word = word[:-1]
    for suffix in ("ing", "ed"):
        if len(word) > len(suffix) + 2 and word.endswith(suffix):
            word = word[:-len(suffix)]
            break
    if len(word) > 3 and word.endswith("e"):
        word = word[:-1]
    return word
