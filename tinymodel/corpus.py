"""The synthetic training corpus of the tiny model: deterministic documents (stories, facts,
numbers, lists, records, dialogues, copies, long-range recall) over a generated lexicon.
`generate_corpus(num_docs, seed)` is a pure function of its arguments; a change to what it
produces needs `tinymodel.builder.BUILDER_VERSION` bumped."""

from __future__ import annotations

import random
from dataclasses import dataclass

NAMES = [
    "Alice", "Bob", "Carol", "David", "Emma", "Frank", "Grace", "Henry", "Iris", "Jack",
    "Kate", "Liam", "Mia", "Noah", "Olivia", "Paul", "Quinn", "Rosa", "Sam", "Tina",
]  # fmt: skip
ANIMALS = [
    "cat", "dog", "fox", "bird", "horse", "rabbit", "mouse", "owl", "bear", "wolf",
    "duck", "goat", "sheep", "frog", "lion", "tiger",
]  # fmt: skip
ADJECTIVES = [
    "small", "big", "red", "green", "blue", "happy", "quiet", "old", "young", "brave",
    "lazy", "clever", "tired", "bright", "dark", "gentle", "loud", "tiny", "warm", "cold",
]  # fmt: skip
PLACES = [
    "garden", "forest", "river", "market", "school", "library", "kitchen", "park",
    "village", "station", "beach", "mountain", "farm", "bridge", "harbor", "castle",
]  # fmt: skip
VERBS = [
    "walked", "ran", "jumped", "looked", "waited", "slept", "sang", "danced", "played",
    "worked", "read", "ate",
]  # fmt: skip
PREPS = ["to", "near", "behind", "inside", "around", "across", "under", "past"]
OBJECTS = [
    "book", "apple", "lamp", "chair", "letter", "map", "key", "basket", "hat", "cup",
    "clock", "ball", "box", "coat", "ring", "stone",
]  # fmt: skip
JOBS = ["baker", "teacher", "doctor", "farmer", "pilot", "painter", "writer", "sailor", "cook"]
TIMES = ["morning", "afternoon", "evening", "night", "spring", "summer", "autumn", "winter"]
FOODS = [
    "apples", "bread", "milk", "eggs", "cheese", "rice", "beans", "tea", "coffee", "butter",
    "honey", "soup", "carrots", "onions", "salt", "sugar",
]  # fmt: skip
CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid",
    "Japan": "Tokyo", "Egypt": "Cairo", "Canada": "Ottawa", "Peru": "Lima",
    "Kenya": "Nairobi", "Norway": "Oslo", "Greece": "Athens", "Chile": "Santiago",
}  # fmt: skip
SOUNDS = {
    "cat": "meow", "dog": "woof", "cow": "moo", "duck": "quack", "sheep": "baa",
    "owl": "hoot", "lion": "roar", "frog": "ribbit",
}  # fmt: skip
COLORS_OF = {
    "sky": "blue", "grass": "green", "sun": "yellow", "snow": "white", "night": "black",
    "blood": "red", "sea": "blue", "banana": "yellow", "coal": "black", "milk": "white",
}  # fmt: skip
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = [
    "January", "February", "March", "April", "May", "June", "July", "August", "September",
    "October", "November", "December",
]  # fmt: skip
NUMBER_WORDS = [
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
    "eleven", "twelve",
]  # fmt: skip


_ONSETS = "b br d dr f g gr h k l m n p r s st t tr v z sh th ch w".split()
_VOWELS = "a e i o u ai ea ou y".split()
_CODAS = ["", "", "n", "r", "l", "s", "th", "ck", "m", "nd", "rk", "x"]


@dataclass(frozen=True)
class _Lexicon:
    """Seeded pseudo-words: they give BPE enough material to fill the vocabulary."""

    surnames: tuple[str, ...]
    towns: tuple[str, ...]
    town_food: dict[str, str]

    @classmethod
    def make(cls, r: random.Random, size: int) -> _Lexicon:
        def word(syllables: int) -> str:
            parts = [r.choice(_ONSETS) + r.choice(_VOWELS) for _ in range(syllables)]
            return _cap("".join(parts) + r.choice(_CODAS))

        words: list[str] = []
        seen: set[str] = set()
        while len(words) < 2 * size:
            w = word(r.randint(2, 3))
            if w not in seen:
                seen.add(w)
                words.append(w)
        towns = tuple(words[size:])
        return cls(tuple(words[:size]), towns, {t: r.choice(FOODS) for t in towns})


def _plural(word: str) -> str:
    return word + ("es" if word.endswith(("x", "s", "ch")) else "s")


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


@dataclass(frozen=True)
class _Cast:
    """The entities of one story. Sentences reuse them, so predicting a later sentence pays
    off only by attending to the earlier ones: the model learns to use distant context."""

    names: tuple[str, ...]
    surnames: dict[str, str]
    jobs: dict[str, str]
    animals: tuple[str, ...]
    places: tuple[str, ...]
    objects: tuple[str, ...]
    adjectives: tuple[str, ...]
    town: str

    @classmethod
    def make(cls, r: random.Random, lex: _Lexicon) -> _Cast:
        names = tuple(r.sample(NAMES, 2))
        return cls(
            names=names,
            surnames={n: r.choice(lex.surnames) for n in names},
            jobs={n: r.choice(JOBS) for n in names},
            animals=tuple(r.sample(ANIMALS, 2)),
            places=tuple(r.sample(PLACES, 2)),
            objects=tuple(r.sample(OBJECTS, 2)),
            adjectives=tuple(r.sample(ADJECTIVES, 3)),
            town=r.choice(lex.towns),
        )


def _sentence(r: random.Random, c: _Cast) -> str:
    name, other = r.sample(c.names, 2)
    animal, animal2 = r.sample(c.animals, 2)
    adj, adj2 = r.sample(c.adjectives, 2)
    place, obj = r.choice(c.places), r.choice(c.objects)
    n = r.randint(2, 12)
    templates = [
        f"the {adj} {animal} {r.choice(VERBS)} {r.choice(PREPS)} the {place}.",
        f"{name} saw a {adj} {animal} in the {place}.",
        f"in the {r.choice(TIMES)}, {name} went to the {place} with {NUMBER_WORDS[n]} "
        f"{_plural(obj)}.",
        f"the {animal} and the {animal2} {r.choice(VERBS)} together.",
        f"{name} gave the {adj2} {obj} to {other}.",
        f"{name} is a {c.jobs[name]} who lives near the {place}.",
        f"there are {n} {_plural(animal)} in the {place}.",
        f"{name} {c.surnames[name]} lives in {c.town}.",
        f"the town of {c.town} is near the {place}.",
        f"{name} {c.surnames[name]} and {other} {c.surnames[other]} are friends.",
        f"the {obj} is {adj} and the {animal} is {adj2}.",
    ]
    return _cap(r.choice(templates))


def _doc_story(r: random.Random, lex: _Lexicon) -> str:
    cast = _Cast.make(r, lex)
    return " ".join(_sentence(r, cast) for _ in range(r.randint(4, 10)))


def _doc_facts(r: random.Random, lex: _Lexicon) -> str:
    out = []
    for _ in range(r.randint(3, 6)):
        kind = r.randrange(4)
        if kind == 0:
            country = r.choice(list(CAPITALS))
            out.append(f"The capital of {country} is {CAPITALS[country]}.")
        elif kind == 1:
            animal = r.choice(list(SOUNDS))
            out.append(f"The {animal} says {SOUNDS[animal]}.")
        elif kind == 2:
            thing = r.choice(list(COLORS_OF))
            out.append(f"The color of the {thing} is {COLORS_OF[thing]}.")
        else:
            town = r.choice(lex.towns)
            out.append(f"{town} is famous for its {lex.town_food[town]}.")
    return " ".join(out)


def _doc_numbers(r: random.Random, lex: _Lexicon) -> str:
    kind = r.randrange(4)
    if kind == 0:
        start, step, n = r.randint(0, 90), r.choice([1, 1, 1, 2, 5, 10]), r.randint(5, 12)
        return "Count: " + ", ".join(str(start + i * step) for i in range(n)) + "."
    if kind == 1:
        lines = []
        for _ in range(r.randint(2, 5)):
            a, b = r.randint(0, 9), r.randint(0, 9)
            lines.append(f"{a} plus {b} is {a + b}.")
        return " ".join(lines)
    if kind == 2:
        i = r.randrange(7)
        n = r.randint(3, 7)
        return "The days are " + ", ".join(DAYS[(i + k) % 7] for k in range(n)) + "."
    i = r.randrange(12)
    n = r.randint(3, 8)
    return "The months are " + ", ".join(MONTHS[(i + k) % 12] for k in range(n)) + "."


def _doc_list(r: random.Random, lex: _Lexicon) -> str:
    if r.random() < 0.5:
        items = r.sample(FOODS, r.randint(3, 6))
        return "Shopping list:\n" + "\n".join(f"- {item}" for item in items)
    items = r.sample(ANIMALS, r.randint(3, 5))
    head = ", ".join(f"a {a}" for a in items[:-1])
    return f"{r.choice(NAMES)} has {head} and a {items[-1]}."


def _doc_record(r: random.Random, lex: _Lexicon) -> str:
    name, surname, job = r.choice(NAMES), r.choice(lex.surnames), r.choice(JOBS)
    city = r.choice(lex.towns + tuple(CAPITALS.values()))
    age, pet = r.randint(18, 80), r.choice(ANIMALS)
    return (
        f"name: {name} {surname}\nage: {age}\njob: {job}\ncity: {city}\npet: {pet}\n"
        f"{name} {surname} is a {job} from {city}. {name} is {age} years old and has a {pet}."
    )


def _doc_dialog(r: random.Random, lex: _Lexicon) -> str:
    turns = []
    for _ in range(r.randint(1, 3)):
        kind = r.randrange(5)
        if kind == 0:
            country = r.choice(list(CAPITALS))
            q = f"What is the capital of {country}?"
            a = f"The capital of {country} is {CAPITALS[country]}."
        elif kind == 1:
            n = r.randint(3, 9)
            q, a = f"Count to {n}.", ", ".join(str(i) for i in range(1, n + 1)) + "."
        elif kind == 2:
            thing = r.choice(list(COLORS_OF))
            q, a = f"What color is the {thing}?", f"The {thing} is {COLORS_OF[thing]}."
        elif kind == 3:
            q, a = r.choice(["Hello!", "Hi!", "Hello there."]), "Hello! How can I help you today?"
        else:
            q, a = "Tell me a story.", _doc_story(r, lex)
        turns.append(f"user: {q}\nassistant: {a}\n")
    return "".join(turns)


def _doc_copy(r: random.Random, lex: _Lexicon) -> str:
    """Verbatim recall of earlier context (pushes attention to look far back)."""
    pool = (ANIMALS, OBJECTS, PLACES, ADJECTIVES, FOODS, lex.towns, lex.surnames)
    words = [
        str(r.randint(0, 999)) if r.random() < 0.15 else r.choice(r.choice(pool))
        for _ in range(r.randint(4, 24))
    ]
    text = " ".join(words)
    if r.random() < 0.5:
        return f"Repeat: {text}\nAgain: {text}"
    return f"user: Repeat after me: {text}\nassistant: {text}\n"


_FILLERS = [
    "It was a {adj} {time}.",
    "The wind was {adj}.",
    "Nothing happened for {n} days.",
    "Time passed slowly.",
    "The road was long and quiet.",
    "Rain fell all {time}.",
    "Far away, a bell rang {n} times.",
    "The clouds were {adj} that day.",
]


def _doc_focus(r: random.Random, lex: _Lexicon) -> str:
    """One hero, named up front and again after runs of hero-free filler sentences, so that
    predicting it needs attention tens of tokens back. Learned only with ~1000 train steps."""
    if r.random() < 0.6:
        hero = r.choice(ANIMALS)
        the_hero = f"the {hero}"
        intro = f"This is a story about a {hero}."
    else:
        hero = the_hero = r.choice(NAMES)
        intro = f"This is a story about {hero}."
    out = [intro]
    for _ in range(r.randint(3, 6)):
        for _ in range(r.randint(1, 4)):
            out.append(
                r.choice(_FILLERS).format(
                    adj=r.choice(ADJECTIVES), time=r.choice(TIMES), n=NUMBER_WORDS[r.randint(2, 12)]
                )
            )
        hero_sentences = [
            f"{the_hero} {r.choice(VERBS)} {r.choice(PREPS)} the {r.choice(PLACES)}.",
            f"{the_hero} was very {r.choice(ADJECTIVES)}.",
            f"everyone loved {the_hero}.",
            f"{the_hero} found a {r.choice(OBJECTS)}.",
            f"at last {the_hero} {r.choice(VERBS)}.",
        ]
        out.append(_cap(r.choice(hero_sentences)))
    out.append(f"That was the story of {the_hero}.")
    return " ".join(out)


LEXICON_SIZE = 300
_GENERATORS = (
    _doc_story,
    _doc_story,
    _doc_facts,
    _doc_numbers,
    _doc_list,
    _doc_record,
    _doc_dialog,
    _doc_copy,
    _doc_focus,
    _doc_focus,
)


def generate_corpus(num_docs: int, seed: int) -> list[str]:
    """Deterministic list of synthetic documents (pure function of its arguments)."""
    r = random.Random(seed)
    lex = _Lexicon.make(r, LEXICON_SIZE)
    return [r.choice(_GENERATORS)(r, lex) for _ in range(num_docs)]
