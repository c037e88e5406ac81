"""Instruction data generated from a seed: arithmetic word problems, offline.

A programmatic instruction-tuning set for federated fine-tuning of small
causal language models without the Hugging Face hub. Every example is a word
problem with a short exact answer (a number or a name), so a greedily
generated answer can be scored by exact match
(:func:`fedlr.data.instruct_text.exact_match`).

Six operation families, each with several phrasings and names/objects drawn
from small word lists:

===================  ====================================  ==============
family               operations                            answer
===================  ====================================  ==============
``addition``         a+b                                   number
``subtraction``      a-b (always positive)                 number
``multiplication``   a*b                                   number
``comparison``       max, min, argmax, argmin of 2 or 3    number or name
``two-step``         a*b-c, a+b-c, (a+b)*c, c-a-b, a*b+c   number
``unit-conversion``  a*b (to the smaller unit), a/b        number
===================  ====================================  ==============

An example is a dict (:class:`Example`)::

    {"instruction": "Maya had 41 shells and gave 17 of them to Hugo. How many "
                    "shells does Maya have left?",
     "response": "24", "family": "subtraction", "operation": "a-b",
     "operands": [41, 17], "options": []}

``operands`` are the problem's numbers (for ``unit-conversion`` the second is
the conversion factor), ``options`` the names an ``argmax``/``argmin`` answer
is chosen from (for ``unit-conversion`` the from- and to-unit), so the answer
can be recomputed from the example alone.

Pieces:

- :func:`generate_examples` / :func:`make_splits`: the data, deterministic in
  the seed (a :class:`numpy.random.Generator`), unique instructions, a
  train/test split that keeps every problem (family, operation, operands) on
  one side, so the test set has neither the train instructions nor
  paraphrases of them;
- :func:`partition_examples`: client partitions, ``iid`` or
  ``family-dirichlet`` (each client's family mix drawn from Dir(α·1): small α,
  one or two families per client);
- prompts, answer scoring and the offline tokenizer:
  :mod:`fedlr.data.instruct_text`;
- :func:`to_dataset` / :func:`load_arith_instruct`: a
  :class:`datasets.Dataset` in the dataset registry's schema (``text`` = the
  instruction, ``label`` = the family).

The module imports only numpy at import time; ``datasets``, ``tokenizers`` and
``transformers`` are imported by the functions that need them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypedDict

import numpy as np
from numpy.typing import NDArray

if TYPE_CHECKING:
    import datasets

__all__ = [
    "DATASET_NAME",
    "FAMILIES",
    "OPERATIONS",
    "PARTITION_SCHEMES",
    "Example",
    "InstructionConfig",
    "InstructionSplits",
    "generate_examples",
    "load_arith_instruct",
    "make_splits",
    "partition_examples",
    "partition_family_counts",
    "split_examples",
    "to_dataset",
]

logger = logging.getLogger("fedlr")

DATASET_NAME = "arith-instruct"
"""Registry name of the generated set, and its folder in the asset cache."""

FAMILIES = (
    "addition",
    "subtraction",
    "multiplication",
    "comparison",
    "two-step",
    "unit-conversion",
)
"""The operation families, in label order."""

PARTITION_SCHEMES = ("iid", "family-dirichlet")
"""Known values of ``scheme`` in :func:`partition_examples`."""

_MAX_SEED = 2**32 - 1


class Example(TypedDict):
    """One generated example (see the module docstring)."""

    instruction: str
    response: str
    family: str
    operation: str
    operands: list[int]
    options: list[str]


def _argmax(o: Sequence[int]) -> int:
    return max(range(len(o)), key=o.__getitem__)


def _argmin(o: Sequence[int]) -> int:
    return min(range(len(o)), key=o.__getitem__)


OPERATIONS: Mapping[str, Callable[[Sequence[int]], int]] = {
    "a+b": lambda o: o[0] + o[1],
    "a-b": lambda o: o[0] - o[1],
    "a*b": lambda o: o[0] * o[1],
    "a/b": lambda o: o[0] // o[1],  # generated so that it divides exactly
    "max": max,
    "min": min,
    "argmax": _argmax,  # an index into ``options``
    "argmin": _argmin,
    "a*b-c": lambda o: o[0] * o[1] - o[2],
    "a+b-c": lambda o: o[0] + o[1] - o[2],
    "(a+b)*c": lambda o: (o[0] + o[1]) * o[2],
    "c-a-b": lambda o: o[2] - o[0] - o[1],
    "a*b+c": lambda o: o[0] * o[1] + o[2],
}
"""Operation name -> function of the operands (``argmax``/``argmin`` give the
index of the answer in ``options``)."""

_NAME_ANSWERS = frozenset({"argmax", "argmin"})

# ----------------------------------------------------------------- word lists

_NAMES = (
    "Anna", "Ben", "Carla", "David", "Emma", "Felix", "Grace", "Hugo", "Ivy",
    "Jack", "Kira", "Liam", "Maya", "Noah", "Olga", "Pablo", "Quinn", "Rosa",
    "Sam", "Tara",
)  # fmt: skip
_OBJECTS = (
    "apples", "pencils", "marbles", "stickers", "books", "cookies", "coins",
    "stamps", "cards", "shells", "balloons", "oranges", "beads", "candles",
    "flowers", "buttons",
)  # fmt: skip
_CONTAINERS = ("boxes", "bags", "baskets", "jars", "packs", "trays", "crates", "bowls")
# (larger unit, smaller unit, factor)
_UNITS = (
    ("meters", "centimeters", 100),
    ("kilometers", "meters", 1000),
    ("kilograms", "grams", 1000),
    ("liters", "milliliters", 1000),
    ("hours", "minutes", 60),
    ("minutes", "seconds", 60),
    ("days", "hours", 24),
    ("weeks", "days", 7),
    ("years", "months", 12),
    ("feet", "inches", 12),
)

# Fields: {n} {m} {k} distinct names, {obj} objects, {cont} containers,
# {a} {b} {c} numbers, {big} {small} units. Unused fields are ignored.
_ADDITION = (
    "{n} has {a} {obj} and then finds {b} more. How many {obj} does {n} have now?",
    "{n} has {a} {obj} and {m} has {b} {obj}. How many {obj} do they have together?",
    "What is {a} plus {b}?",
    "Add {a} and {b}.",
    "A basket holds {a} {obj}. {n} puts in {b} more. How many {obj} are in the "
    "basket now?",
    "{n} collected {a} {obj} on Monday and {b} {obj} on Tuesday. How many {obj} "
    "did {n} collect in total?",
)
_SUBTRACTION = (
    "{n} had {a} {obj} and gave {b} of them to {m}. How many {obj} does {n} have left?",
    "What is {a} minus {b}?",
    "Subtract {b} from {a}.",
    "There were {a} {obj} in a box. {n} took {b} out. How many {obj} are left "
    "in the box?",
    "{n} has {a} {obj} and {m} has {b} {obj}. How many more {obj} does {n} "
    "have than {m}?",
    "A shop had {a} {obj} and sold {b} of them. How many {obj} does the shop have now?",
)
_MULTIPLICATION = (
    "There are {a} {cont} with {b} {obj} in each. How many {obj} are there in total?",
    "What is {a} times {b}?",
    "Multiply {a} by {b}.",
    "{n} buys {a} {cont} of {obj} with {b} {obj} in each. How many {obj} does {n} buy?",
    "Each of {a} children has {b} {obj}. How many {obj} do the children have "
    "altogether?",
    "{n} puts {b} {obj} into each of {a} {cont}. How many {obj} does {n} use?",
)
# (template, operation, number of values)
_COMPARISON = (
    ("{n} has {a} {obj} and {m} has {b} {obj}. Who has more {obj}?", "argmax", 2),
    ("{n} has {a} {obj} and {m} has {b} {obj}. Who has fewer {obj}?", "argmin", 2),
    ("Which number is larger, {a} or {b}?", "max", 2),
    ("Which number is smaller, {a} or {b}?", "min", 2),
    (
        "{n} has {a} {obj}, {m} has {b} {obj} and {k} has {c} {obj}. Who has "
        "the most {obj}?",
        "argmax",
        3,
    ),
    ("What is the largest of {a}, {b} and {c}?", "max", 3),
    (
        "{n} scored {a} points and {m} scored {b} points. Who scored more points?",
        "argmax",
        2,
    ),
    ("What is the smallest of {a}, {b} and {c}?", "min", 3),
)
_TWO_STEP = (
    (
        "{n} has {a} {cont} with {b} {obj} in each and gives away {c} {obj}. "
        "How many {obj} does {n} have left?",
        "a*b-c",
    ),
    (
        "{n} has {a} {obj}, buys {b} more and then gives {c} to {m}. How many "
        "{obj} does {n} have now?",
        "a+b-c",
    ),
    (
        "A shop sells {a} red pens and {b} blue pens every day. How many pens "
        "does it sell in {c} days?",
        "(a+b)*c",
    ),
    (
        "{n} reads {a} pages on Monday and {b} pages on Tuesday. The book has "
        "{c} pages. How many pages are left to read?",
        "c-a-b",
    ),
    (
        "There are {a} {cont} with {b} {obj} each and {c} more {obj} on the "
        "table. How many {obj} are there altogether?",
        "a*b+c",
    ),
)
# (template, to the smaller unit?)
_UNIT_CONVERSION = (
    ("How many {small} are in {a} {big}?", True),
    ("Convert {a} {big} to {small}.", True),
    ("{n} measured {a} {big}. How many {small} is that?", True),
    ("{a} {big} is how many {small}?", True),
    ("How many {big} are in {a} {small}?", False),
    ("Convert {a} {small} to {big}.", False),
    ("{n} measured {a} {small}. How many {big} is that?", False),
)


# --------------------------------------------------------------------- config


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclass(frozen=True)
class InstructionConfig:
    """Settings of the generated set.

    Attributes
    ----------
    num_examples : int
        Examples in all (train + test), >= 1.
    seed : int
        Seed of the generator and of the split, in ``[0, 2**32)``.
    test_fraction : float
        Share of each family held out as the test split, in ``[0, 1)``.
    families : tuple of str
        Families to generate, a non-empty subset of :data:`FAMILIES`.
    weights : tuple of float or None
        Share of each family (normalised), same length as ``families``; equal
        shares when ``None``. Family counts are exact (largest remainder).

    Raises
    ------
    ValueError
        On construction, naming the field and the bad value.
    """

    num_examples: int = 10_000
    seed: int = 0
    test_fraction: float = 0.1
    families: tuple[str, ...] = FAMILIES
    weights: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        count, seed, frac = self.num_examples, self.seed, self.test_fraction
        for name, valid, must in (
            ("num_examples", _is_int(count) and count >= 1, "an integer >= 1"),
            ("seed", _is_int(seed) and 0 <= seed <= _MAX_SEED,
             "an integer in [0, 2**32)"),
            ("test_fraction", isinstance(frac, numbers.Real) and 0 <= float(frac) < 1,
             "in [0, 1)"),
        ):  # fmt: skip
            if not valid:
                raise ValueError(f"{name} must be {must}, got {getattr(self, name)!r}")
        families = tuple(self.families)
        unknown = [f for f in families if f not in FAMILIES]
        if not families or unknown or len(set(families)) != len(families):
            raise ValueError(
                f"families must be distinct names from {', '.join(FAMILIES)}, "
                f"got {self.families!r}"
            )
        object.__setattr__(self, "families", families)
        if self.weights is not None:
            weights = tuple(float(w) for w in self.weights)
            if len(weights) != len(families) or not all(
                math.isfinite(w) and w > 0 for w in weights
            ):
                raise ValueError(
                    f"weights must be {len(families)} positive finite numbers "
                    f"(one per family), got {self.weights!r}"
                )
            object.__setattr__(self, "weights", weights)

    def family_counts(self) -> dict[str, int]:
        """Return how many examples of each family are generated (exact).

        Returns
        -------
        dict of str to int
            Family -> count, summing to ``num_examples`` (largest remainder).
        """
        weights = np.asarray(self.weights or [1.0] * len(self.families))
        share = weights / weights.sum() * self.num_examples
        counts = np.floor(share).astype(np.int64)
        short = self.num_examples - int(counts.sum())
        # the largest remainders get one more; ties go to the earlier family
        order = np.argsort(-(share - counts), kind="stable")
        counts[order[:short]] += 1
        return dict(zip(self.families, counts.tolist(), strict=True))


def _digest(payload: Mapping[str, Any]) -> str:
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# ----------------------------------------------------------------- generation


def _distinct(rng: np.random.Generator, high: int, count: int, k: int) -> NDArray[Any]:
    """(count, k) integers in ``[0, high)``, distinct within each row."""
    out = rng.integers(0, high, size=(count, k))
    while k > 1:
        srt = np.sort(out, axis=1)
        bad = np.flatnonzero((np.diff(srt, axis=1) == 0).any(axis=1))
        if bad.size == 0:
            break
        out[bad] = rng.integers(0, high, size=(bad.size, k))
    return out


def _between(
    rng: np.random.Generator, low: NDArray[Any] | int, high: NDArray[Any] | int, n: int
) -> NDArray[np.int64]:
    """Integers uniform in ``[low, high]`` (inclusive, element-wise)."""
    return rng.integers(low, np.asarray(high) + 1, size=n).astype(np.int64)


def _example(
    family: str,
    template: str,
    operation: str,
    operands: list[int],
    options: list[str],
    fields: dict[str, Any],
) -> Example:
    value = OPERATIONS[operation](operands)
    response = options[value] if operation in _NAME_ANSWERS else str(value)
    return Example(
        instruction=template.format(**fields),
        response=response,
        family=family,
        operation=operation,
        operands=operands,
        options=options,
    )


def _words(rng: np.random.Generator, count: int) -> tuple[NDArray[Any], ...]:
    """Names (count, 3) distinct per row, object and container indices."""
    names = _distinct(rng, len(_NAMES), count, 3)
    objects = rng.integers(0, len(_OBJECTS), size=count)
    containers = rng.integers(0, len(_CONTAINERS), size=count)
    return names, objects, containers


def _fields(
    names: NDArray[Any], objects: NDArray[Any], containers: NDArray[Any], i: int
) -> dict[str, Any]:
    n, m, k = (_NAMES[j] for j in names[i])
    return {
        "n": n,
        "m": m,
        "k": k,
        "obj": _OBJECTS[objects[i]],
        "cont": _CONTAINERS[containers[i]],
    }


def _gen_binary(
    family: str,
    templates: tuple[str, ...],
    operation: str,
    a: NDArray[np.int64],
    b: NDArray[np.int64],
    rng: np.random.Generator,
) -> list[Example]:
    count = a.size
    tpl = rng.integers(0, len(templates), size=count)
    names, objects, containers = _words(rng, count)
    out = []
    for i in range(count):
        ai, bi = int(a[i]), int(b[i])
        fields = _fields(names, objects, containers, i) | {"a": ai, "b": bi}
        out.append(_example(family, templates[tpl[i]], operation, [ai, bi], [], fields))
    return out


def _gen_addition(rng: np.random.Generator, count: int) -> list[Example]:
    a = _between(rng, 2, 99, count)
    b = _between(rng, 2, 99, count)
    return _gen_binary("addition", _ADDITION, "a+b", a, b, rng)


def _gen_subtraction(rng: np.random.Generator, count: int) -> list[Example]:
    a = _between(rng, 10, 99, count)
    b = _between(rng, 2, a - 1, count)
    return _gen_binary("subtraction", _SUBTRACTION, "a-b", a, b, rng)


def _gen_multiplication(rng: np.random.Generator, count: int) -> list[Example]:
    a = _between(rng, 2, 12, count)
    b = _between(rng, 2, 20, count)
    return _gen_binary("multiplication", _MULTIPLICATION, "a*b", a, b, rng)


def _gen_comparison(rng: np.random.Generator, count: int) -> list[Example]:
    tpl = rng.integers(0, len(_COMPARISON), size=count)
    values = _distinct(rng, 98, count, 3) + 2  # distinct, in [2, 99]
    names, objects, containers = _words(rng, count)
    out = []
    for i in range(count):
        template, operation, arity = _COMPARISON[tpl[i]]
        operands = [int(v) for v in values[i, :arity]]
        fields = _fields(names, objects, containers, i)
        fields |= dict(zip("abc", operands, strict=False))
        options = [fields[key] for key in "nmk"[:arity]] if "{n}" in template else []
        out.append(
            _example("comparison", template, operation, operands, options, fields)
        )
    return out


def _gen_two_step(rng: np.random.Generator, count: int) -> list[Example]:
    tpl = rng.integers(0, len(_TWO_STEP), size=count)
    ops = np.array([op for _, op in _TWO_STEP])[tpl]
    small = np.isin(ops, ("a*b-c", "a*b+c"))  # a, b are factors
    a = np.where(small, _between(rng, 2, 9, count), _between(rng, 2, 40, count))
    b = np.where(small, _between(rng, 2, 12, count), _between(rng, 2, 40, count))
    u = rng.random(count)
    c = np.select(
        [ops == "a*b-c", ops == "a+b-c", ops == "(a+b)*c", ops == "c-a-b"],
        [
            1 + np.floor(u * (a * b - 1)),  # in [1, a*b - 1]: a positive answer
            1 + np.floor(u * (a + b - 1)),
            2 + np.floor(u * 8),  # days in [2, 9]
            a + b + 1 + np.floor(u * 150),  # a longer book
        ],
        default=2 + np.floor(u * 29),  # a*b+c: in [2, 30]
    ).astype(np.int64)
    names, objects, containers = _words(rng, count)
    out = []
    for i in range(count):
        template, operation = _TWO_STEP[tpl[i]]
        operands = [int(a[i]), int(b[i]), int(c[i])]
        fields = _fields(names, objects, containers, i)
        fields |= dict(zip("abc", operands, strict=True))
        out.append(_example("two-step", template, operation, operands, [], fields))
    return out


def _gen_unit_conversion(rng: np.random.Generator, count: int) -> list[Example]:
    tpl = rng.integers(0, len(_UNIT_CONVERSION), size=count)
    unit = rng.integers(0, len(_UNITS), size=count)
    value = _between(rng, 2, 99, count)
    names, objects, containers = _words(rng, count)
    out = []
    for i in range(count):
        template, down = _UNIT_CONVERSION[tpl[i]]
        big, small, factor = _UNITS[unit[i]]
        v = int(value[i])
        shown = v if down else v * factor
        operation, options = ("a*b", [big, small]) if down else ("a/b", [small, big])
        fields = _fields(names, objects, containers, i)
        fields |= {"a": shown, "big": big, "small": small}
        out.append(
            _example(
                "unit-conversion", template, operation, [shown, factor], options, fields
            )
        )
    return out


_GENERATORS: Mapping[str, Callable[[np.random.Generator, int], list[Example]]] = {
    "addition": _gen_addition,
    "subtraction": _gen_subtraction,
    "multiplication": _gen_multiplication,
    "comparison": _gen_comparison,
    "two-step": _gen_two_step,
    "unit-conversion": _gen_unit_conversion,
}
_MAX_ROUNDS = 50
_MIN_NEW_RATE = 0.02  # give up when fewer draws than this are new instructions


def generate_examples(config: InstructionConfig | None = None) -> list[Example]:
    """Generate the examples: unique instructions, exact family counts.

    Parameters
    ----------
    config : InstructionConfig, optional
        Defaults to ``InstructionConfig()`` (10,000 examples, seed 0).

    Returns
    -------
    list of Example
        ``config.num_examples`` examples in a seeded random order, families
        interleaved, counts as :meth:`InstructionConfig.family_counts`. The
        same config gives the same list.

    Raises
    ------
    ValueError
        If a family cannot produce that many distinct instructions: the
        phrasings and number ranges are finite, from 44,100 distinct unit
        conversions to millions of additions, and drawing stops when fewer
        than 2% of the draws are new.
    """
    config = config or InstructionConfig()
    rng = np.random.default_rng(config.seed)
    seen: set[str] = set()
    examples: list[Example] = []
    for family, want in config.family_counts().items():
        got, rate = 0, 1.0  # rate: share of new instructions in the last draw
        for _ in range(_MAX_ROUNDS):
            if got == want:
                break
            need, before = want - got, got
            # draw a little more than needed, more when duplicates were common
            # (at least 200, so that the share of new ones is well measured;
            # at most 2 * want, so that an impossible request fails soon)
            size = math.ceil(1.05 * need / max(rate, 0.05)) + 1
            size = max(min(size, 2 * want), 200)
            for ex in _GENERATORS[family](rng, size):
                if ex["instruction"] not in seen:
                    seen.add(ex["instruction"])
                    examples.append(ex)
                    got += 1
                    if got == want:
                        break
            rate = (got - before) / size
            if got < want and rate < _MIN_NEW_RATE:  # (nearly) exhausted
                break
        if got < want:
            raise ValueError(
                f"family '{family}' gave only {got} distinct instructions of the "
                f"{want} asked for: its phrasings and number ranges are (nearly) "
                "exhausted; lower num_examples or this family's weight"
            )
    order = rng.permutation(len(examples))
    return [examples[i] for i in order]


@dataclass(frozen=True)
class InstructionSplits:
    """The generated set split into train and test.

    Attributes
    ----------
    config : InstructionConfig
    train, test : list of Example
        Disjoint; no instruction string, and no problem (family, operation,
        operands) under another phrasing, is in both.
    """

    config: InstructionConfig
    train: list[Example]
    test: list[Example]


def _problem_key(ex: Example) -> tuple[str, str, tuple[int, ...]]:
    return ex["family"], ex["operation"], tuple(ex["operands"])


def split_examples(
    examples: Sequence[Example], test_fraction: float, seed: int
) -> tuple[list[Example], list[Example]]:
    """Split examples into train and test by problem, stratified by family.

    For each family, whole problems (examples with the same family, operation
    and operands: paraphrases of one another) go to the test split in a seeded
    random order until it holds ``round(test_fraction * n_family)`` examples
    (a problem with several phrasings can overshoot by a few).

    Parameters
    ----------
    examples : sequence of Example
    test_fraction : float
        In ``[0, 1)``.
    seed : int

    Returns
    -------
    (train, test) : tuple of list of Example
        Both in the input order.
    """
    if not 0 <= test_fraction < 1:
        raise ValueError(f"test_fraction must be in [0, 1), got {test_fraction!r}")
    rng = np.random.default_rng([seed, 1])  # its own stream, not the generator's
    groups: dict[str, dict[tuple[Any, ...], list[int]]] = {}
    for i, ex in enumerate(examples):
        groups.setdefault(ex["family"], {}).setdefault(_problem_key(ex), []).append(i)
    is_test = np.zeros(len(examples), dtype=bool)
    for family in sorted(groups):
        problems = list(groups[family].values())
        target = round(test_fraction * sum(len(p) for p in problems))
        taken = 0
        for j in rng.permutation(len(problems)):
            if taken >= target:
                break
            is_test[problems[j]] = True
            taken += len(problems[j])
    train = [ex for ex, t in zip(examples, is_test, strict=True) if not t]
    test = [ex for ex, t in zip(examples, is_test, strict=True) if t]
    return train, test


def make_splits(config: InstructionConfig | None = None) -> InstructionSplits:
    """Generate the examples and split them into train and test.

    Parameters
    ----------
    config : InstructionConfig, optional
        Defaults to ``InstructionConfig()``.

    Returns
    -------
    InstructionSplits
    """
    config = config or InstructionConfig()
    train, test = split_examples(
        generate_examples(config), float(config.test_fraction), config.seed
    )
    return InstructionSplits(config=config, train=train, test=test)


# ---------------------------------------------------------------- partitions


def _family_codes(families: Sequence[str]) -> tuple[NDArray[np.int64], list[str]]:
    names = [f for f in FAMILIES if f in set(families)]
    names += sorted(set(families) - set(names))
    index = {f: i for i, f in enumerate(names)}
    return np.fromiter((index[f] for f in families), np.int64, len(families)), names


def partition_examples(
    families: Sequence[str],
    num_partitions: int,
    *,
    scheme: str = "family-dirichlet",
    alpha: float = 0.5,
    seed: int = 0,
    min_partition_size: int = 1,
) -> list[list[int]]:
    """Partition examples among clients, IID or skewed by family.

    ``iid``: a seeded shuffle cut into ``num_partitions`` contiguous shards.

    ``family-dirichlet``: client ``p`` draws its family mix
    ``q_p ~ Dir(alpha * 1_F)``; the clients then take examples in turns (a
    seeded order each round), each drawing a family from ``q_p`` restricted
    to the families that still have examples left (the family with the most
    examples left when none of its mix is), until every client has its
    quota. Small ``alpha``: each client holds mostly one or two families
    (as far as they last: with fewer clients P than families F, a client's
    N/P examples outnumber a family's N/F, so its top family is at most a
    share P/F of it); large ``alpha``: close to IID. Partition sizes differ
    by at most one in both schemes.

    Parameters
    ----------
    families : sequence of str, length N
        The ``family`` of each example (e.g. ``[ex["family"] for ex in train]``
        or a dataset's ``family`` column).
    num_partitions : int
        Number of clients P >= 1.
    scheme : {"iid", "family-dirichlet"}
    alpha : float
        Dirichlet concentration > 0 (``family-dirichlet`` only).
    seed : int
    min_partition_size : int
        Every partition must get at least this many examples (>= 1).

    Returns
    -------
    list of list of int
        P lists of indices into ``families``: disjoint, covering ``range(N)``,
        each non-empty.

    Raises
    ------
    ValueError
        For an unknown scheme, ``alpha <= 0``, ``num_partitions < 1``, or when
        N examples cannot give every partition ``min_partition_size``.
    """
    _check_partitioning(
        len(families), num_partitions, scheme, alpha, min_partition_size
    )
    rng = np.random.default_rng(seed)
    if scheme == "iid":
        return [
            s.tolist()
            for s in np.array_split(rng.permutation(len(families)), num_partitions)
        ]
    return _family_dirichlet(families, num_partitions, alpha, rng)


def _check_partitioning(
    n: int, num_partitions: int, scheme: str, alpha: float, min_partition_size: int
) -> None:
    """Refuse arguments :func:`partition_examples` cannot partition ``n``
    examples with (``ValueError`` naming the argument)."""
    if scheme not in PARTITION_SCHEMES:
        raise ValueError(
            f"scheme must be one of {', '.join(PARTITION_SCHEMES)}, got {scheme!r}"
        )
    if not _is_int(num_partitions) or num_partitions < 1:
        raise ValueError(
            f"num_partitions must be an integer >= 1, got {num_partitions!r}"
        )
    if not _is_int(min_partition_size) or min_partition_size < 1:
        raise ValueError(
            f"min_partition_size must be an integer >= 1, got {min_partition_size!r}"
        )
    if not isinstance(alpha, numbers.Real) or not math.isfinite(alpha) or alpha <= 0:
        raise ValueError(f"alpha must be > 0 and finite, got {alpha!r}")
    if n < num_partitions * min_partition_size:
        raise ValueError(
            f"{n} examples cannot fill {num_partitions} partitions with at least "
            f"{min_partition_size} each; use at most {n // min_partition_size} "
            "partitions or generate more examples"
        )


def _family_dirichlet(
    families: Sequence[str], num_partitions: int, alpha: float, rng: np.random.Generator
) -> list[list[int]]:
    """``family-dirichlet`` (:func:`partition_examples`): each client's family
    mix from ``Dir(alpha)``, then the clients draw in seeded turns."""
    n = len(families)
    codes, names = _family_codes(families)
    num_families = len(names)
    mix = rng.dirichlet(np.full(num_families, float(alpha)), size=num_partitions)
    pools = [
        rng.permutation(np.flatnonzero(codes == f)).tolist()
        for f in range(num_families)
    ]
    left = [len(pool) for pool in pools]
    quota = [
        n // num_partitions + (p < n % num_partitions) for p in range(num_partitions)
    ]
    # 1. the order of turns: round r lets every client with quota > r draw once
    turns = [
        int(p)
        for r in range(max(quota))
        for p in rng.permutation(num_partitions)
        if quota[p] > r
    ]
    draws = rng.random(len(turns)).tolist()
    q = mix.tolist()
    out: list[list[int]] = [[] for _ in range(num_partitions)]
    for p, u in zip(turns, draws, strict=True):
        # 2. the client's mix over families that still have examples
        weights = [w if k else 0.0 for w, k in zip(q[p], left, strict=True)]
        total = sum(weights)
        if not total > 0:  # every family of the mix ran out (or underflowed):
            # take the family with the most examples left, keeping the skew
            best = max(range(num_families), key=left.__getitem__)
            weights = [1.0 if j == best else 0.0 for j in range(num_families)]
            total = 1.0
        # 3. inverse-CDF draw of a family, then its next example
        target, acc, f = u * total, 0.0, -1
        for j, w in enumerate(weights):
            if w > 0:
                f = j
                acc += w
                if target < acc:
                    break
        out[p].append(pools[f][len(pools[f]) - left[f]])
        left[f] -= 1
    return out


def partition_family_counts(
    families: Sequence[str], partitions: Sequence[Sequence[int]]
) -> NDArray[np.int64]:
    """Count the examples of each family in each partition.

    Parameters
    ----------
    families : sequence of str, length N
    partitions : sequence of P index lists

    Returns
    -------
    (P, F) int array
        Columns in :data:`FAMILIES` order (families absent from ``families``
        left out; unknown ones last, sorted).
    """
    codes, names = _family_codes(families)
    counts = np.zeros((len(partitions), len(names)), dtype=np.int64)
    for p, idx in enumerate(partitions):
        counts[p] = np.bincount(
            codes[np.asarray(idx, dtype=np.int64)], minlength=len(names)
        )
    return counts


# ------------------------------------------------------------------ datasets


def to_dataset(
    examples: Sequence[Example], splits: Sequence[str] | None = None
) -> datasets.Dataset:
    """Return the examples as a :class:`datasets.Dataset`.

    Columns: ``text`` (the instruction: the registry's text column),
    ``instruction``, ``response``, ``family``, ``operation``, ``operands``,
    ``options``, ``label`` (``ClassLabel`` over :data:`FAMILIES`: the
    registry's label, so label-based partitioners skew by family) and, when
    ``splits`` is given, ``split`` (``"train"``/``"test"``).

    Parameters
    ----------
    examples : sequence of Example
    splits : sequence of str, optional
        One per example.

    Returns
    -------
    datasets.Dataset
    """
    import datasets

    columns: dict[str, list[Any]] = {
        "text": [ex["instruction"] for ex in examples],
        "instruction": [ex["instruction"] for ex in examples],
        "response": [ex["response"] for ex in examples],
        "family": [ex["family"] for ex in examples],
        "operation": [ex["operation"] for ex in examples],
        "operands": [list(ex["operands"]) for ex in examples],
        "options": [list(ex["options"]) for ex in examples],
        "label": [FAMILIES.index(ex["family"]) for ex in examples],
    }
    features = {
        "text": datasets.Value("string"),
        "instruction": datasets.Value("string"),
        "response": datasets.Value("string"),
        "family": datasets.Value("string"),
        "operation": datasets.Value("string"),
        "operands": datasets.List(datasets.Value("int64")),
        "options": datasets.List(datasets.Value("string")),
        "label": datasets.ClassLabel(names=list(FAMILIES)),
    }
    if splits is not None:
        if len(splits) != len(examples):
            raise ValueError(f"{len(splits)} splits for {len(examples)} examples")
        columns["split"] = list(splits)
        features["split"] = datasets.Value("string")
    return datasets.Dataset.from_dict(columns, features=datasets.Features(features))


def load_arith_instruct() -> datasets.Dataset:
    """Registry loader: the default set (10,000 examples, seed 0), train + test.

    Returns
    -------
    datasets.Dataset
        :func:`to_dataset` of the train split followed by the test split, with
        the ``split`` column. Everything else in the registry re-splits rows at
        random; keep to the ``split`` column to hold out whole problems.
    """
    splits = make_splits(InstructionConfig())
    rows = splits.train + splits.test
    names = ["train"] * len(splits.train) + ["test"] * len(splits.test)
    return to_dataset(rows, names)
