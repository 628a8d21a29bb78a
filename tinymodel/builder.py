"""Build (once) and cache a tiny Llama checkpoint that vLLM can serve, without any download.

The model is trained from scratch on a synthetic, deterministically generated corpus so that
its outputs depend on the prompt and its next-token distribution is peaked (mean top-1
probability ~0.5 with a 2048-token vocabulary), which makes it a usable oracle for KV-cache
transfer tests. Surprise: with the default ~1 minute of training its *greedy tokens* depend
mostly on the last few dozen prompt tokens; a different early KV block shifts the log-probs
(by ~0.1-0.5 nats, far above fp32 kernel noise) but rarely flips a greedy token. KV tests
should therefore compare log-probs, not only tokens. Long-range recall (see ``_doc_focus``)
emerges only at ~1000 train steps (``--steps 1000``, ~4 minutes on 2 cores).

Contract of :func:`ensure_model`: the returned directory is complete (config, safetensors
weights, tokenizer, marker file) and never modified afterwards. Its name is a hash of the
:class:`ModelSpec` and :data:`BUILDER_VERSION`; bump the version whenever the corpus, the
tokenizer or the training recipe changes, so stale caches are not reused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer

BUILDER_VERSION = "2"

MARKER_FILE = "kvcluster_model.json"
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
PAD_TOKEN = "<|pad|>"

# Rendered with transformers' Jinja sandbox. The dialog documents of the training corpus use
# exactly this format, so chat prompts are in-distribution. The BOS comes from the template:
# chat prompts are tokenized with add_special_tokens=False.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)

VLLM_HEAD_DIMS = (32, 64, 80, 96, 112, 128)


@dataclass(frozen=True)
class ModelSpec:
    """Architecture and training recipe of the tiny model; every field feeds the cache key."""

    vocab_size: int = 2048
    hidden_size: int = 256
    intermediate_size: int = 704
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    max_position_embeddings: int = 2048
    train_steps: int = 320
    batch_size: int = 8
    seq_len: int = 128
    learning_rate: float = 1.5e-3
    corpus_docs: int = 6000
    seed: int = 0
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.head_dim not in VLLM_HEAD_DIMS:
            raise ValueError(f"head_dim must be one of {VLLM_HEAD_DIMS} (vLLM-CPU kernels)")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"unsupported dtype {self.dtype!r}")
        if self.vocab_size < 512:
            raise ValueError("vocab_size must be >= 512 (256 byte symbols + merges + specials)")
        if self.seq_len > self.max_position_embeddings:
            raise ValueError("seq_len must not exceed max_position_embeddings")

    def cache_key(self) -> str:
        """Stable hex digest of the spec and BUILDER_VERSION."""
        payload = json.dumps(
            {"builder_version": BUILDER_VERSION, **dataclasses.asdict(self)}, sort_keys=True
        )
        return hashlib.sha256(payload.encode()).hexdigest()[:16]

    def dir_name(self) -> str:
        return f"tinyllama-h{self.hidden_size}-l{self.num_layers}-{self.cache_key()}"


def default_cache_dir() -> Path:
    """``$KVCLUSTER_CACHE_DIR`` if set, else ``~/.cache/kvcluster/models``."""
    env = os.environ.get("KVCLUSTER_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvcluster" / "models"


def is_complete(model_dir: Path) -> bool:
    """True if ``model_dir`` holds a finished build (the marker is written last)."""
    return all(
        (model_dir / name).is_file()
        for name in (MARKER_FILE, "config.json", "model.safetensors", "tokenizer.json")
    )


def ensure_model(spec: ModelSpec = ModelSpec(), cache_dir: Path | None = None) -> Path:
    """Return the directory of the model built from ``spec``, building it if needed.

    Safe for concurrent callers (threads or processes): builders serialize on an fcntl lock
    next to the model directory, build into a temporary directory and publish it with an
    atomic rename, so a half-built directory is never returned. Building changes no global
    state of the caller (torch thread count and RNG states are restored).
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache_dir / spec.dir_name()
    if is_complete(target):
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with _file_lock(cache_dir / f".{spec.dir_name()}.lock"):
        if is_complete(target):
            return target
        if target.exists():  # not produced by us (rename is atomic): stale, replace it
            shutil.rmtree(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{spec.dir_name()}.tmp-", dir=cache_dir))
        try:
            os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
            _build(spec, tmp)
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _log(msg: str) -> None:
    print(f"[tinymodel] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# Synthetic corpus
# --------------------------------------------------------------------------------------------

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


# --------------------------------------------------------------------------------------------
# Build
# --------------------------------------------------------------------------------------------


def _train_tokenizer(docs: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE; the post-processor prepends <bos>, as Llama tokenizers do."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS_TOKEN, EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer)
    bos_id = tok.token_to_id(BOS_TOKEN)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tok


def _save_tokenizer(tok: Tokenizer, spec: ModelSpec, out: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE,
        model_max_length=spec.max_position_embeddings,
    )
    hf_tok.save_pretrained(out, save_jinja_files=False)
    # transformers 5 writes tokenizer_class "TokenizersBackend", unknown to transformers 4.x;
    # the classic name loads in both. The chat template stays inside tokenizer_config.json.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg["add_bos_token"] = True
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


@contextlib.contextmanager
def _isolated_torch(seed: int, threads: int = 2) -> Iterator[None]:
    """Seed torch/random/numpy and cap threads; restore the caller's state afterwards."""
    import numpy as np
    import torch

    saved = (
        random.getstate(),
        np.random.get_state(),
        torch.get_rng_state(),
        torch.get_num_threads(),
        torch.are_deterministic_algorithms_enabled(),
    )
    try:
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        torch.set_num_threads(max(1, min(threads, os.cpu_count() or 1)))
        torch.use_deterministic_algorithms(True)
        yield
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        torch.set_rng_state(saved[2])
        torch.set_num_threads(saved[3])
        torch.use_deterministic_algorithms(saved[4])


def _build(spec: ModelSpec, out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    t0 = time.monotonic()
    _log(f"building {spec.dir_name()} into {out.parent}")
    docs = generate_corpus(spec.corpus_docs, spec.seed)
    tok = _train_tokenizer(docs, spec.vocab_size)
    _log(
        f"corpus {len(docs)} docs, {sum(map(len, docs))} chars; tokenizer trained "
        f"({time.monotonic() - t0:.1f}s)"
    )
    _save_tokenizer(tok, spec, out)
    bos_id, eos_id, pad_id = (tok.token_to_id(t) for t in (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN))

    # Documents are packed into one stream as "<bos> doc <eos>", like the serving prompts
    # (the tokenizer prepends <bos>); training windows are sampled at random offsets.
    stream: list[int] = []
    for enc in tok.encode_batch(docs):
        stream.extend(enc.ids)  # the post-processor already put <bos> first
        stream.append(eos_id)
    data = torch.tensor(stream, dtype=torch.long)

    # BPE may stop short of vocab_size on a small corpus; the embedding keeps the spec's size.
    if tok.get_vocab_size() > spec.vocab_size:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} > {spec.vocab_size} tokens")
    config = LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
        dtype=spec.dtype,
    )

    with _isolated_torch(spec.seed):
        model = LlamaForCausalLM(config).float()
        model.train()
        n_params = sum(p.numel() for p in model.parameters())
        _log(
            f"{n_params / 1e6:.2f}M params, {len(stream)} training tokens; "
            f"{spec.train_steps} steps of {spec.batch_size}x{spec.seq_len}"
        )
        opt = torch.optim.AdamW(
            model.parameters(), lr=spec.learning_rate, betas=(0.9, 0.95), weight_decay=0.01
        )
        warmup = max(1, spec.train_steps // 15)

        def lr_at(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = (step - warmup) / max(1, spec.train_steps - warmup)
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
        gen = torch.Generator().manual_seed(spec.seed)
        offsets_span = len(stream) - spec.seq_len - 1
        log_every = max(1, spec.train_steps // 10)
        loss_val = float("nan")
        for step in range(spec.train_steps):
            starts = torch.randint(0, offsets_span, (spec.batch_size,), generator=gen)
            idx = starts[:, None] + torch.arange(spec.seq_len + 1)[None, :]
            batch = data[idx]
            logits = model(input_ids=batch[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)
            )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            loss_val = loss.item()
            if (step + 1) % log_every == 0 or step == 0:
                _log(
                    f"step {step + 1}/{spec.train_steps} loss {loss_val:.3f} "
                    f"({time.monotonic() - t0:.1f}s)"
                )

        model.eval()
        model = model.to(getattr(torch, spec.dtype))
        model.generation_config.bos_token_id = bos_id
        model.generation_config.eos_token_id = eos_id
        model.generation_config.pad_token_id = pad_id
        model.save_pretrained(out)

    for f in out.iterdir():
        f.chmod(0o644)  # safetensors leaves 0600
    elapsed = time.monotonic() - t0
    marker = {
        "builder_version": BUILDER_VERSION,
        "spec": dataclasses.asdict(spec),
        "final_loss": round(loss_val, 4),
        "build_seconds": round(elapsed, 1),
    }
    # Written last: its presence is what makes the directory complete.
    (out / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
    _log(f"done: final loss {loss_val:.3f} in {elapsed:.1f}s")
