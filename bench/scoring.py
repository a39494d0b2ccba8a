"""The PolicyDesk scorer's rules, pure functions (tested in ``tests/test_faithfulness.py``):

- **key-fact accuracy** of one answer: an answerable item is right when its answer contains
  every key fact after :func:`normalize` (see :func:`contains_fact` for the matching rules); an
  unanswerable one is right when the answer abstains (:data:`ABSTAIN_PATTERNS`) and states no
  number that is not in the question (:func:`unanswerable_correct`).
- **grounding**: the share of the answer's content words (lowercased, :data:`STOP_WORDS`
  removed) that occur in the system message the model was given (system prompt + policy).
- **agreement** with a reference: the share of items whose greedy answers have identical token
  ids; **first divergence**: the token index where two different answers first differ (the
  shorter one's length when one is a prefix of the other).

Limits: the scorer is literal. A right answer that spells a number differently from the
policy ("two" for "2", "5.6" for "5.60", "9.30" for "09:30") counts as wrong; an abstention
phrased in words not in the list counts as wrong; an abstention followed by an invented claim
without a number counts as right; grounding counts words, not claims (a false sentence made of
policy words scores 1.0).
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence

# ---- normalisation and key facts ----------------------------------------------------------------

_DASHES = re.compile("[\u2010\u2011\u2012\u2013\u2014\u2015\u2212\ufe58\ufe63\uff0d]")
_QUOTES = str.maketrans({"\u2018": "'", "\u2019": "'", "\u201b": "'", "\u2032": "'", "\u201c": '"', "\u201d": '"'})
_GROUP_SPACE = re.compile("(?<=\\d)[\u00a0\u2009\u202f](?=\\d{3}(?!\\d))")   # 1 000 with a thin/no-break space
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")                           # 1,500 -> 1500
_DECIMAL_COMMA = re.compile(r"(?<=\d),(?=\d{1,2}(?!\d))")                     # 5,60 -> 5.60
_CURRENCY = re.compile(r"[€$£¥]|\b(?:eur|euros?|usd|gbp)\b")
_PERCENT = re.compile(r"\s*(?:%|\bper ?cent\b)")
_HOUR_ZERO = re.compile(r"(?<![\d.:])0(\d:\d\d)")                                # 09:30 -> 9:30


def normalize(text: str) -> str:
    """Text as the scorer compares it, in this order: thousand groups joined across no-break
    and thin spaces ("1 000" → "1000"); Unicode NFKC; lowercase; curly quotes → straight;
    every Unicode dash and minus → "-"; thousands commas removed ("1,500" → "1500"); a comma
    before 1-2 final digits read as a decimal comma ("5,60" → "5.60"); currency symbols and
    codes removed ("€1,500" and "1500 EUR" → "1500"); "percent"/"per cent" and " %" → "%";
    a leading zero dropped from clock times ("09:30" → "9:30"); runs of whitespace → one space.
    Not handled: number words ("two"), "." thousand separators ("1.000" stays a decimal),
    trailing decimal zeros ("5.6" ≠ "5.60")."""
    s = _GROUP_SPACE.sub("", text)
    s = unicodedata.normalize("NFKC", s).lower().translate(_QUOTES)
    s = _DASHES.sub("-", s)
    s = _THOUSANDS.sub("", s)
    s = _DECIMAL_COMMA.sub(".", s)
    s = _CURRENCY.sub(" ", s)
    s = _PERCENT.sub("%", s)
    s = _HOUR_ZERO.sub(r"\1", s)
    return re.sub(r"\s+", " ", s).strip()


def contains_fact(answer: str, fact: str) -> bool:
    """True when the normalised ``fact`` occurs in the normalised ``answer``, as a whole number
    or word at its start: a fact starting with a letter or digit may not follow a letter or
    digit ("two" is not found in "network"), one starting with a digit may not follow "<digit>."
    ("5" is not in "0.5"), and one ending with a digit may not be followed by a digit or by
    "."/"," and a digit ("15" is not in "150" or "15.5"). A fact ending with a letter may be
    followed by more letters ("line manager" is in "line managers")."""
    f = normalize(fact)
    if not f:
        raise ValueError("empty key fact")
    pattern = re.escape(f)
    if f[0].isalnum():
        pattern = r"(?<![^\W_])" + pattern
    if f[0].isdigit():
        pattern = r"(?<!\d[.,])" + pattern
    if f[-1].isdigit():
        pattern += r"(?!\d|[.,]\d)"
    return re.search(pattern, normalize(answer)) is not None


def key_facts_correct(answer: str, key_facts: Sequence[str]) -> bool:
    """True when ``answer`` contains every key fact (:func:`contains_fact`)."""
    return all(contains_fact(answer, f) for f in key_facts)


# An abstention: the answer says the policy does not cover the question. Matched on the
# normalised answer (lowercase, straight apostrophes).
ABSTAIN_PATTERNS: tuple[str, ...] = (
    r"\bdo(?:es)?(?: not|n't|nt) (?:say|specify|state|mention|cover|contain|address|provide|include|"
    r"indicate|discuss|define|list|give|set|describe|tell)\b",
    r"\bnot (?:mentioned|specified|stated|covered|addressed|defined|listed|included|described|provided|"
    r"say|said)\b",
    r"\bno (?:specific |further |such |relevant )?(?:information|mention|details?|guidance|rule|provision)s?\b",
    r"\bnot (?:in|part of|found in) the policy\b",
    r"\bi (?:do not|don't|dont) know\b",
    r"\b(?:cannot|can't|can not|unable to) (?:find|answer|determine|tell|say)\b",
    r"\bsilent on\b",
)
_ABSTAIN = re.compile("|".join(f"(?:{p})" for p in ABSTAIN_PATTERNS))
_NUMBER = re.compile(r"\d+(?:[.:]\d+)*")


def abstains(answer: str) -> bool:
    """True when ``answer`` matches one of :data:`ABSTAIN_PATTERNS` ("The policy does not say.",
    "doesn't specify", "not mentioned", "no information", "not covered", "I don't know" ...)."""
    return _ABSTAIN.search(normalize(answer)) is not None


def new_numbers(answer: str, question: str) -> list[str]:
    """Numbers (digit runs, with "." or ":" inside) in ``answer`` that are not in ``question``."""
    asked = set(_NUMBER.findall(normalize(question)))
    return [n for n in _NUMBER.findall(normalize(answer)) if n not in asked]


def unanswerable_correct(answer: str, question: str) -> bool:
    """An unanswerable question is answered right when the answer abstains (:func:`abstains`)
    and asserts no made-up figure: it states no number that the question does not contain.
    Pattern-based: an abstention plus an invented claim without a number still counts as right."""
    return abstains(answer) and not new_numbers(answer, question)


def is_correct(answer: str, question: dict) -> bool:
    """Score one answer to a PolicyDesk question record (``key_facts``, ``answerable``, ``question``)."""
    if question["answerable"]:
        return key_facts_correct(answer, question["key_facts"])
    return unanswerable_correct(answer, question["question"])



# ---- grounding ----------------------------------------------------------------------------------

STOP_WORDS = frozenset("""
a an the and or but if then else so than that this these those there here of in on at to for from
by with without about as into over under after before between during within per up down out off
is are was were be been being am do does did doing done have has had having can could may might
must shall should will would i you he she it we they me him her us them my your his its our
their mine yours what which who whom whose when where why how all any both each every few more
most other some such no nor not only own same too very just also yes one s t don't doesn't
isn't aren't can't won't please
""".split())
_WORD = re.compile(r"[^\W_]+(?:['.-][^\W_]+)*")


def content_words(text: str) -> list[str]:
    """The words of normalised ``text`` (letters/digits, joined by inner ' . -) that are not in
    :data:`STOP_WORDS`, in order, repeats kept."""
    return [w for w in _WORD.findall(normalize(text)) if w not in STOP_WORDS]


def grounding(answer: str, source: str) -> float | None:
    """Share of ``answer``'s content words that occur as words in ``source`` (the system
    message: system prompt + policy). None for an answer without content words."""
    words = content_words(answer)
    if not words:
        return None
    vocab = set(_WORD.findall(normalize(source)))
    return sum(w in vocab for w in words) / len(words)


# ---- agreement ----------------------------------------------------------------------------------

def first_divergence(a: Sequence, b: Sequence) -> int | None:
    """Index of the first position where token sequences ``a`` and ``b`` differ; the shorter
    one's length when it is a prefix of the other; None when they are identical."""
    if list(a) == list(b):
        return None
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def agreement(answers: Sequence[Sequence[int]], reference: Sequence[Sequence[int]]) -> dict:
    """Greedy agreement of token-id sequences with the reference's, pairwise:
    ``agreement`` (share identical), ``num_diverging``, ``mean_first_divergence`` (token index,
    over diverging pairs only; None when every pair is identical)."""
    if len(answers) != len(reference) or not answers:
        raise ValueError(f"need the same non-zero number of answers, got {len(answers)} and {len(reference)}")
    div = [first_divergence(a, r) for a, r in zip(answers, reference)]
    diverging = [d for d in div if d is not None]
    return {"agreement": 1 - len(diverging) / len(div), "num_diverging": len(diverging),
            "mean_first_divergence": sum(diverging) / len(diverging) if diverging else None}
