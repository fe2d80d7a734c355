"""The lexical guard refuses the hard negatives that embeddings cannot tell apart."""

from __future__ import annotations

import pytest

from caching.guard import content_words, same_question
from caching.semantic import passes_guard


@pytest.mark.parametrize(("a", "b"), [
    ("What is the capital of France?", "What is the capital of Germany?"),  # one slot
    ("Convert 5 km to miles", "Convert 5 miles to km"),  # same words, other order
    ("What is 15% of 200?", "What is 20% of 150?"),  # numbers
    ("Interest on $10,000 at 5%", "Interest on $10,000 at 7%"),
    ("When did World War II end?", "When did World War I end?"),  # roman numerals
    ("How do I enable two-factor authentication?", "How do I disable two-factor authentication?"),
    ("Why do leaves change color in autumn?", "Why do leaves fall in autumn?"),  # 2 -> 1 words
    ("Is it safe to eat raw eggs?", "Is it not safe to eat raw eggs?"),  # a negation inserted
    ("How do I undo my last git push?",  # one word against three, the rest equal
     "How do I undo my last git commit but keep the changes?"),
])
def test_refuses_changed_slots(a: str, b: str) -> None:
    assert not same_question(a, b)
    assert not same_question(b, a)


@pytest.mark.parametrize(("a", "b"), [
    ("How do I cancel my subscription?", "What are the steps to cancel my subscription?"),
    ("Who painted the Mona Lisa?", "Which artist painted the Mona Lisa?"),  # only an insertion
    ("What is a Roth IRA?", "Can you explain what a Roth IRA is?"),
    ("How long should I boil an egg for a soft yolk?",
     "How many minutes do I boil an egg to get a runny yolk?"),  # reworded in several places
    ("what's the capital of France", "What is the capital of France?"),
])
def test_passes_rewordings(a: str, b: str) -> None:
    assert same_question(a, b)
    assert same_question(b, a)


def test_content_words_drop_function_words_and_stem() -> None:
    assert content_words("What's the way to bake databases?") == ["bak", "databas"]
    assert content_words("How do I NOT bake it before noon?") == ["not", "bak", "befor", "noon"]


def test_passes_guard_needs_both_texts_when_asked() -> None:
    assert passes_guard(None, None)  # no text asked for: cosine alone decides
    assert passes_guard(None, "anything")
    assert not passes_guard("What is a Roth IRA?", None)  # asked, but nothing to compare with
    assert passes_guard("What is a Roth IRA?", "Can you explain what a Roth IRA is?")
    assert not passes_guard("What is a Roth IRA?", "What is a traditional IRA?")
