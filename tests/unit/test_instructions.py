"""Tests of fedlr.data.instructions: generated arithmetic instruction data.

Answers are recomputed here from the numbers parsed out of the instruction
with this file's own operation and unit tables, not the module's.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedlr.data import instruct_text
from fedlr.data import instructions as instr
from fedlr.data.instruct_text import (
    DEFAULT_TEMPLATE,
    SPECIAL_TOKENS,
    build_tokenizer,
    encode_example,
    exact_match,
    extract_answer,
    format_example,
    format_prompt,
    tokenizer_path,
    train_tokenizer,
)
from fedlr.data.instructions import (
    FAMILIES,
    Example,
    InstructionConfig,
    generate_examples,
    load_arith_instruct,
    make_splits,
    partition_examples,
    partition_family_counts,
    to_dataset,
)

# this file's own answer rules: operands -> value (an index for arg*)
RULES: dict[str, Any] = {
    "a+b": lambda a, b: a + b,
    "a-b": lambda a, b: a - b,
    "a*b": lambda a, b: a * b,
    "a/b": lambda a, b: a / b,
    "max": lambda *v: max(v),
    "min": lambda *v: min(v),
    "argmax": lambda *v: v.index(max(v)),
    "argmin": lambda *v: v.index(min(v)),
    "a*b-c": lambda a, b, c: a * b - c,
    "a+b-c": lambda a, b, c: a + b - c,
    "(a+b)*c": lambda a, b, c: (a + b) * c,
    "c-a-b": lambda a, b, c: c - a - b,
    "a*b+c": lambda a, b, c: a * b + c,
}
FAMILY_OPERATIONS = {
    "addition": {"a+b"},
    "subtraction": {"a-b"},
    "multiplication": {"a*b"},
    "comparison": {"max", "min", "argmax", "argmin"},
    "two-step": {"a*b-c", "a+b-c", "(a+b)*c", "c-a-b", "a*b+c"},
    "unit-conversion": {"a*b", "a/b"},
}
UNIT_FACTORS = {
    ("meters", "centimeters"): 100,
    ("kilometers", "meters"): 1000,
    ("kilograms", "grams"): 1000,
    ("liters", "milliliters"): 1000,
    ("hours", "minutes"): 60,
    ("minutes", "seconds"): 60,
    ("days", "hours"): 24,
    ("weeks", "days"): 7,
    ("years", "months"): 12,
    ("feet", "inches"): 12,
}
NUMBER = re.compile(r"\d+")
SMALL = InstructionConfig(num_examples=1_500, seed=3)


@pytest.fixture(scope="module")
def default_examples() -> list[Example]:
    return generate_examples()


@pytest.fixture(scope="module")
def default_splits() -> instr.InstructionSplits:
    return make_splits()


# ------------------------------------------------------------------ generation


def test_same_seed_same_data_other_seed_other_data() -> None:
    first = generate_examples(SMALL)
    assert generate_examples(SMALL) == first
    other = generate_examples(InstructionConfig(num_examples=1_500, seed=4))
    same_text = sum(
        a["instruction"] == b["instruction"] for a, b in zip(first, other, strict=True)
    )
    assert same_text < 5  # different problems, not a reordering
    assert (
        len({e["instruction"] for e in first} & {e["instruction"] for e in other}) < 100
    )


def test_ten_thousand_examples_with_distinct_instructions() -> None:
    # (Speed is not asserted here: a timed test fails on a busy machine.)
    examples = generate_examples(InstructionConfig(num_examples=10_000, seed=11))
    assert len(examples) == 10_000
    assert len({e["instruction"] for e in examples}) == 10_000


def test_every_family_with_its_share(default_examples: list[Example]) -> None:
    counts = Counter(e["family"] for e in default_examples)
    assert set(counts) == set(FAMILIES)
    assert sorted(counts.values()) == [1666, 1666, 1667, 1667, 1667, 1667]
    assert counts == InstructionConfig().family_counts()
    weighted = InstructionConfig(
        num_examples=800, families=("addition", "comparison"), weights=(3.0, 1.0)
    )
    assert Counter(e["family"] for e in generate_examples(weighted)) == {
        "addition": 600,
        "comparison": 200,
    }
    # families are interleaved, not in blocks
    first = [e["family"] for e in default_examples[:60]]
    assert len(set(first)) == len(FAMILIES)


def test_instructions_are_unique_and_phrasings_varied(
    default_examples: list[Example],
) -> None:
    texts = [e["instruction"] for e in default_examples]
    assert len(set(texts)) == len(texts)
    for family in FAMILIES:
        rows = [e for e in default_examples if e["family"] == family]
        # a phrasing = the instruction with numbers and names masked out
        shapes = {
            NUMBER.sub("#", re.sub(r"\b[A-Z][a-z]+\b", "X", e["instruction"]))
            for e in rows
        }
        assert len(shapes) >= 4, family
        assert {e["operation"] for e in rows} == FAMILY_OPERATIONS[family]


def _check_answer(ex: Example) -> None:
    text, ops, opts = ex["instruction"], ex["operands"], ex["options"]
    numbers = [int(n) for n in NUMBER.findall(text)]
    if ex["family"] == "unit-conversion":
        # the text shows the amount; the factor comes from the unit words
        assert numbers == [ops[0]], text
        source, target = opts
        assert re.search(rf"\b{ops[0]} {source}\b", text), text
        assert re.search(rf"\b{target}\b", text), text
        pair = (source, target) if ex["operation"] == "a*b" else (target, source)
        assert ops[1] == UNIT_FACTORS[pair], text
    else:
        assert Counter(numbers) == Counter(ops), text
    value = RULES[ex["operation"]](*ops)
    if ex["operation"] in ("argmax", "argmin"):
        assert len(opts) == len(ops)
        # each name is followed by its own number in the text
        for name, number in zip(opts, ops, strict=True):
            assert re.search(rf"\b{name} (has|scored) {number}\b", text), text
        assert ex["response"] == opts[value]
    else:
        assert value == int(value) and value > 0, text
        assert ex["response"] == str(int(value)), text


def test_answers_recomputed_from_the_text(default_examples: list[Example]) -> None:
    rng = np.random.default_rng(0)
    for family in FAMILIES:
        rows = [e for e in default_examples if e["family"] == family]
        for i in rng.choice(len(rows), size=300, replace=False):
            _check_answer(rows[i])
    names = [e for e in default_examples if e["operation"] in ("argmax", "argmin")]
    assert len(names) > 300  # the name-answer path is exercised
    assert all(
        re.fullmatch(r"\d+|[A-Z][a-z]+", e["response"]) for e in default_examples
    )


def test_split_has_no_shared_instruction_or_problem(
    default_splits: instr.InstructionSplits,
) -> None:
    train, test = default_splits.train, default_splits.test
    assert len(train) + len(test) == 10_000
    assert not {e["instruction"] for e in train} & {e["instruction"] for e in test}

    def problem(e: Example) -> tuple[Any, ...]:
        return e["family"], e["operation"], tuple(e["operands"])

    assert not {problem(e) for e in train} & {problem(e) for e in test}
    per_family = Counter(e["family"] for e in test)
    assert set(per_family) == set(FAMILIES)
    for family, count in per_family.items():
        assert 166 <= count <= 180, (family, count)
    again = make_splits()
    assert again.test == test and again.train == train
    assert make_splits(InstructionConfig(test_fraction=0.0)).test == []


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_examples": 0}, "num_examples"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**32}, "seed"),
        ({"test_fraction": 1.0}, "test_fraction"),
        ({"families": ("addition", "division")}, "families"),
        ({"families": ()}, "families"),
        ({"families": ("addition", "addition")}, "families"),
        ({"weights": (1.0, 2.0)}, "weights"),
        ({"families": ("addition",), "weights": (0.0,)}, "weights"),
    ],
)
def test_config_rejects_bad_values(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        InstructionConfig(**kwargs)


def test_a_family_that_cannot_be_that_large_is_a_value_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # one unit pair: (5 phrasings + 2 phrasings x 20 names) x 98 amounts
    monkeypatch.setattr(instr, "_UNITS", instr._UNITS[:1])
    capacity = (5 + 2 * 20) * 98
    ok = InstructionConfig(num_examples=capacity // 2, families=("unit-conversion",))
    assert len(generate_examples(ok)) == capacity // 2
    big = InstructionConfig(num_examples=capacity + 1, families=("unit-conversion",))
    with pytest.raises(ValueError, match="exhausted"):
        generate_examples(big)


# ------------------------------------------------------------------ partitions


def _check_partition(parts: list[list[int]], n: int, num_partitions: int) -> None:
    assert len(parts) == num_partitions
    assert all(len(p) > 0 for p in parts)
    flat = [i for p in parts for i in p]
    assert len(flat) == len(set(flat)) == n  # disjoint
    assert sorted(flat) == list(range(n))  # cover
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("scheme", ["iid", "family-dirichlet"])
@pytest.mark.parametrize("num_partitions", [1, 3, 8])
def test_partitions_disjoint_cover_non_empty(
    default_splits: instr.InstructionSplits, scheme: str, num_partitions: int
) -> None:
    families = [e["family"] for e in default_splits.train]
    parts = partition_examples(
        families, num_partitions, scheme=scheme, alpha=0.3, seed=5
    )
    _check_partition(parts, len(families), num_partitions)
    assert parts == partition_examples(
        families, num_partitions, scheme=scheme, alpha=0.3, seed=5
    )
    if num_partitions > 1:
        other = partition_examples(
            families, num_partitions, scheme=scheme, alpha=0.3, seed=6
        )
        assert other != parts


def _skew(families: list[str], alpha: float) -> tuple[float, float]:
    """Mean top-1 and top-2 family share per partition over three seeds."""
    top1, top2 = [], []
    for seed in range(3):
        parts = partition_examples(families, 8, alpha=alpha, seed=seed)
        counts = partition_family_counts(families, parts)
        shares = np.sort(counts / counts.sum(axis=1, keepdims=True), axis=1)
        top1.append(shares[:, -1].mean())
        top2.append(shares[:, -2:].sum(axis=1).mean())
    return float(np.mean(top1)), float(np.mean(top2))


def test_family_skew_grows_as_alpha_shrinks(
    default_splits: instr.InstructionSplits,
) -> None:
    families = [e["family"] for e in default_splits.train]
    iid = partition_examples(families, 8, scheme="iid", seed=0)
    iid_counts = partition_family_counts(families, iid)
    iid_top1 = iid_counts.max(axis=1) / iid_counts.sum(axis=1)
    skews = {alpha: _skew(families, alpha) for alpha in (100.0, 1.0, 0.1, 0.01)}
    top1 = [skews[a][0] for a in (100.0, 1.0, 0.1, 0.01)]
    assert top1 == sorted(top1)  # monotone in 1/alpha
    # measured (8 clients, 8,987 rows): top-1 0.19, 0.36, 0.51, 0.60;
    # top-2 0.37, 0.59, 0.81, 0.92
    assert iid_top1.mean() < 0.2 and top1[0] < 0.21  # large alpha: about IID (1/6)
    assert top1[-1] > 0.5
    assert skews[0.01][1] > 0.8  # small alpha: mostly one or two families
    assert skews[100.0][1] < 0.4


def test_partition_errors() -> None:
    families = ["addition"] * 3 + ["comparison"] * 2
    with pytest.raises(ValueError, match="cannot fill 6 partitions"):
        partition_examples(families, 6)
    with pytest.raises(ValueError, match="at least 2 each"):
        partition_examples(families, 3, min_partition_size=2)
    with pytest.raises(ValueError, match="alpha"):
        partition_examples(families, 2, alpha=0.0)
    with pytest.raises(ValueError, match="scheme"):
        partition_examples(families, 2, scheme="pathological")
    with pytest.raises(ValueError, match="num_partitions"):
        partition_examples(families, 0)
    # exactly one example each is possible
    _check_partition(partition_examples(families, 5, alpha=0.01), 5, 5)


# ------------------------------------------------------------------- prompts


def test_format_prompt_and_example() -> None:
    ex = {"instruction": "What is 2 plus 3?", "response": "5"}
    assert format_prompt(ex["instruction"]) == (
        "### Instruction:\nWhat is 2 plus 3?\n\n### Response:\n"
    )
    assert format_example(ex) == (format_prompt(ex["instruction"]), "5")
    custom = "Q: {instruction} {not a field}\nA:"
    assert format_prompt("x?", custom) == "Q: x? {not a field}\nA:"
    with pytest.raises(ValueError, match="instruction"):
        format_prompt("x", "no placeholder")


def test_exact_match() -> None:
    assert extract_answer("  42.\nand then more") == "42"
    assert extract_answer("\n\nAnna\n") == "Anna"
    assert extract_answer("") == ""
    assert exact_match("42", "42") and exact_match(" 42.\n\nfoo", "42")
    assert exact_match("anna", "Anna")
    assert not exact_match("4", "42") and not exact_match("420", "42")


# ----------------------------------------------------------------- tokenizer


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("fedlr-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FEDLR_CACHE", str(root))
        yield root


@pytest.fixture(scope="module")
def tokenizer(cache: Path) -> Any:
    return build_tokenizer(SMALL, vocab_size=384)


def test_tokenizer_special_tokens_and_size(tokenizer: Any) -> None:
    assert tokenizer.pad_token == SPECIAL_TOKENS["pad_token"]
    assert tokenizer.eos_token == SPECIAL_TOKENS["eos_token"]
    assert tokenizer.bos_token == SPECIAL_TOKENS["bos_token"]
    ids = (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id)
    assert ids == (0, 1, 2)
    assert 300 < len(tokenizer) <= 384
    # digits and punctuation are always single tokens; numbers go digit by digit
    for char in string.digits + string.punctuation:
        assert len(tokenizer(char, add_special_tokens=False)["input_ids"]) == 1, char
    assert tokenizer.tokenize("2580") == ["2", "5", "8", "0"]


def test_tokenizer_round_trips(tokenizer: Any) -> None:
    texts = [
        format_prompt(e["instruction"]) + e["response"] for e in make_splits(SMALL).test
    ]
    texts += ["", "  two  spaces\tand a tab\n", "Zoë paid 3,50 € 😀", "<|eos|>?"]
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text
    assert (
        tokenizer("12", add_special_tokens=True)["input_ids"]
        == tokenizer("12", add_special_tokens=False)["input_ids"]
    )  # encode adds no special tokens


def test_tokenizer_cache_is_reused(
    tokenizer: Any, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tokenizer_path(SMALL, vocab_size=384)
    assert path.parent == cache / "arith-instruct"
    assert (path / "tokenizer.json").is_file()

    def no_training(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the cached tokenizer should have been loaded")

    monkeypatch.setattr(instruct_text, "train_tokenizer", no_training)
    again = build_tokenizer(SMALL, vocab_size=384)
    assert again.get_vocab() == tokenizer.get_vocab()
    assert again.eos_token_id == tokenizer.eos_token_id
    # other settings, other folder
    assert tokenizer_path(SMALL, vocab_size=400) != path
    assert (
        tokenizer_path(InstructionConfig(num_examples=1_500, seed=4), vocab_size=384)
        != path
    )
    assert (
        tokenizer_path(SMALL, vocab_size=384, template="Q: {instruction}\nA: ") != path
    )
    with pytest.raises(AssertionError, match="cached"):
        build_tokenizer(SMALL, vocab_size=400)


def test_tokenizer_training_is_deterministic(tokenizer: Any) -> None:
    fresh = build_tokenizer(SMALL, vocab_size=384, cache=False)
    assert fresh.backend_tokenizer.to_str() == tokenizer.backend_tokenizer.to_str()
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(["abc"], vocab_size=100)


def test_encode_example_masks_the_prompt(tokenizer: Any) -> None:
    ex = make_splits(SMALL).test[0]
    enc = encode_example(ex, tokenizer)
    prompt, response = format_example(ex)
    n_prompt = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    assert len(enc["input_ids"]) == len(enc["labels"]) == len(enc["attention_mask"])
    assert enc["labels"][:n_prompt] == [-100] * n_prompt
    assert enc["labels"][n_prompt:] == enc["input_ids"][n_prompt:]
    assert enc["input_ids"][-1] == tokenizer.eos_token_id
    assert tokenizer.decode(enc["input_ids"][:n_prompt]) == prompt
    assert tokenizer.decode(enc["input_ids"][n_prompt:-1]) == response
    assert len(encode_example(ex, tokenizer, max_length=5)["labels"]) == 5


@pytest.fixture
def chat_tokenizer() -> Any:
    """A minimal local tokenizer with a chat template (nothing from the hub)."""
    tok = train_tokenizer(["hello world, what is 2 plus 3?"] * 4, vocab_size=270)
    tok.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    return tok


def test_chat_template_is_used_when_the_tokenizer_has_one(chat_tokenizer: Any) -> None:
    ex = {"instruction": "What is 2 plus 3?", "response": "5"}
    expected = "<|user|>What is 2 plus 3?\n<|assistant|>"
    assert format_prompt(ex["instruction"], tokenizer=chat_tokenizer) == expected
    # the template argument is ignored on this path
    assert format_example(ex, "Q: {instruction}", tokenizer=chat_tokenizer) == (
        expected,
        "5",
    )
    enc = encode_example(ex, chat_tokenizer)
    assert chat_tokenizer.decode(enc["input_ids"]) == expected + "5<|eos|>"
    assert enc["labels"].count(-100) == len(enc["labels"]) - 2  # "5" and eos
    chat_tokenizer.chat_template = None
    assert format_prompt(ex["instruction"], tokenizer=chat_tokenizer) == (
        DEFAULT_TEMPLATE.replace("{instruction}", ex["instruction"])
    )


# ------------------------------------------------------------------ datasets


def test_dataset_fits_the_registry_schema() -> None:
    import datasets

    from fedlr.data.registry import DatasetSpec, _check_schema

    splits = make_splits(SMALL)
    ds = to_dataset(splits.test)
    spec = DatasetSpec(
        name="arith-instruct",
        kind="text",
        num_classes=len(FAMILIES),
        offline=True,
        loader=load_arith_instruct,
        description="test",
    )
    _check_schema(spec, ds)  # raises on a schema mismatch
    assert isinstance(ds.features["label"], datasets.ClassLabel)
    assert ds.features["label"].names == list(FAMILIES)
    row = ds[0]
    ex = splits.test[0]
    assert row["text"] == row["instruction"] == ex["instruction"]
    assert row["operands"] == ex["operands"] and row["response"] == ex["response"]
    assert FAMILIES[row["label"]] == ex["family"]
    with pytest.raises(ValueError, match="splits"):
        to_dataset(splits.test, ["train"])


def test_registry_loader(default_splits: instr.InstructionSplits) -> None:
    ds = load_arith_instruct()
    assert ds.num_rows == 10_000
    assert Counter(ds["split"]) == {
        "train": len(default_splits.train),
        "test": len(default_splits.test),
    }
    assert ds["instruction"][: len(default_splits.train)] == [
        e["instruction"] for e in default_splits.train
    ]
