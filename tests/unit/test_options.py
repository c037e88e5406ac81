"""Option declarations: ranges, shared keys with per-method defaults, clashes.

A key is declared once per options class (``option(default, help, range=...,
choices=..., bad=...)``); two methods may declare one key with their own
defaults when it is the same setting (type, help, range), and the registry
refuses a key declared as two different settings, naming both methods. The
methods registered here live in a copy of the registry that each test throws
away (``scratch_registry``), so the built-in methods never see them; the shared
key is FedAvgM-LoRA's ``server-lr``, as a FedAdam-LoRA would share it.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass

import pytest

from fedlr.client_apps.payloads import LORA, VERA
from fedlr.configdoc import generate as configdoc
from fedlr.errors import ConfigError
from fedlr.options import (
    METHOD_DEFAULT,
    NoOptions,
    Range,
    bad_values,
    option,
    redeclare,
)
from fedlr.strategies import registration
from fedlr.strategies.fedavg_lora import FedAvgLoRA
from fedlr.strategies.fedavgm_lora import ServerMomentumOptions
from fedlr.strategies.registration import OptionClashError, register_method
from fedlr.strategies.registry import (
    method_defaults,
    option_defaults,
    registered_methods,
    resolve,
)
from fedlr.strategies.vera import VeraStrategy
from fedlr.tasks.vera import VeraOptions

STEP = ServerMomentumOptions.option_fields()["server-lr"].metadata["help"]


@dataclass(frozen=True)
class AdamLike(NoOptions):
    server_lr: float = redeclare(ServerMomentumOptions, "server-lr", 0.01)
    server_beta: float = option(0.9, "first-moment decay", range="[0, 1)")


@pytest.fixture
def scratch_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """The built-in methods, loaded, in a registry the test may add to."""
    registered_methods()
    monkeypatch.setattr(registration, "_REGISTRY", dict(registration._REGISTRY))


def _register(name: str, options: type[NoOptions], base: type = FedAvgLoRA) -> type:
    strategy = type(f"Strategy{abs(hash(name))}", (base,), {})
    register_method(name, payload=LORA, summary="test", options=options)(strategy)
    return strategy


# ------------------------------------------------------------------ ranges
@pytest.mark.parametrize(
    ("text", "inside", "outside", "message"),
    [
        ("[0, 1)", [0.0, 0.5], [1.0, -1.0, math.nan], "in [0, 1)"),
        ("(0, 1]", [1.0, 1e-9], [0.0, 2.0], "in (0, 1]"),
        ("[0, 2**32)", [0, 2**32 - 1], [-1, 2**32], "in [0, 2**32)"),
        (">= 1", [1, 10**9], [0, -1], ">= 1"),
        ("> 0", [1e-300, 5.0], [0.0, math.inf, math.nan], "finite and > 0"),
    ],
)
def test_a_range_holds_what_it_says(text, inside, outside, message):
    range_ = Range.parse(text)
    kind = "int" if "**" in text or text == ">= 1" else "float"
    assert all(v in range_ for v in inside)
    assert not any(v in range_ for v in outside)
    assert range_.phrase(kind) == message
    assert not any(v in range_ for v in range_.outside(kind))


def test_a_declared_range_is_checked_and_gives_the_bad_values():
    @dataclass(frozen=True)
    class Opts(NoOptions):
        share: float = option(0.5, "a share", range="[0, 1)")
        count: int = option(2, "a count", range=">= 1", bad=[(7, "not seven")])
        form: str = option("a", "a form", choices=("a", "b"))

        def check(self) -> None:
            if self.count == 7:
                raise ConfigError("count", "not seven")

    cases = {key: bad_values(key, f) for key, f in Opts.option_fields().items()}
    assert [v for v, _ in cases["share"]] == [-1.0, 1.0]
    assert [v for v, _ in cases["count"]] == [0, 7]
    assert [v for v, _ in cases["form"]] == ["not-a-form"]
    for key, refusals in cases.items():
        for value, message in refusals:
            with pytest.raises(ConfigError, match=message) as info:
                Opts.from_run_config({key: value})
            assert info.value.key == key
    assert Opts.from_run_config({"share": 0.0, "count": 1, "form": "b"}).count == 1


def test_a_declaration_that_contradicts_itself_is_refused():
    with pytest.raises(ValueError, match="outside the range"):
        option(0.0, "a rate", range="> 0")
    with pytest.raises(ValueError, match="not among the choices"):
        option("c", "a form", choices=("a", "b"))
    with pytest.raises(ValueError, match="is not"):
        option(1, "a count", range="1..3")


# --------------------------------------------------------- per-method defaults
def test_a_shared_key_with_two_defaults_registers_and_each_method_gets_its_own(
    scratch_registry,
):
    _register("adam-like", AdamLike)

    defaults = method_defaults()["server-lr"]
    assert defaults["adam-like"] == 0.01 and defaults["fedavgm-lora"] == 1.0
    assert option_defaults()["server-lr"] == METHOD_DEFAULT
    assert option_defaults()["server-beta"] == 0.9
    # Not given, or "" (what pyproject.toml holds): the method's own default.
    for given in ({}, {"server-lr": METHOD_DEFAULT}):
        adam = resolve({"method": "adam-like", **given}).options
        momentum = resolve({"method": "fedavgm-lora", **given}).options
        assert (adam.server_lr, momentum.server_lr) == (0.01, 1.0)
    # A value sets it for either method; its range is the one declaration's.
    assert resolve({"method": "adam-like", "server-lr": 0.5}).options.server_lr == 0.5
    with pytest.raises(ConfigError, match=r"'server-lr': must be finite and > 0"):
        resolve({"method": "fedavgm-lora", "server-lr": 0.0})
    # "" is no value for a key with one default.
    with pytest.raises(ConfigError, match="'server-beta': expected a number"):
        resolve({"method": "adam-like", "server-beta": ""})


def test_the_generated_listings_show_each_methods_default(scratch_registry):
    _register("adam-like", AdamLike)

    body = configdoc.render_pyproject()
    line = next(x for x in body.splitlines() if x.startswith("server-lr ="))
    assert line.startswith('server-lr = ""  # each method\'s own default: ')
    assert "adam-like 0.01" in line and "fedavgm-lora 1.0" in line
    assert tomllib.loads(body)["server-lr"] == METHOD_DEFAULT
    docs = configdoc.render_docs()
    row = next(x for x in docs.splitlines() if x.startswith("| `server-lr` |"))
    assert "`0.01` (`adam-like`)" in row and "`1.0` (`fedavgm-lora`)" in row
    assert row.endswith(f"{STEP}; finite and > 0 |")
    assert 'holds `""` for it' in docs


# ------------------------------------------------------------------ clashes
@pytest.mark.parametrize(
    ("annotation", "declared"),
    [
        ("int", option(1, STEP, range="> 0")),
        ("float", option(1.0, "another meaning", range="> 0")),
        ("float", option(1.0, STEP, range="(0, 1]")),
    ],
    ids=["type", "help", "range"],
)
def test_a_clash_names_both_methods_and_both_declarations(
    scratch_registry, annotation, declared
):
    clashing = dataclass(frozen=True)(
        type(
            "Clashing",
            (NoOptions,),
            {"__annotations__": {"server_lr": annotation}, "server_lr": declared},
        )
    )
    with pytest.raises(OptionClashError) as info:
        _register("clashing", clashing)
    text = str(info.value)
    assert "'server-lr' clashes" in text
    assert "method 'clashing' declares 'server-lr' as Clashing.server_lr" in text
    assert (
        "method 'fedavgm-lora' declares 'server-lr' as ServerMomentumOptions.server_lr"
        in text
    )
    assert "one key is one setting" in text
    assert "clashing" not in [s.name for s in registration.registered()]


@pytest.mark.parametrize("first", ["aa-momentum", "zz-other"])
def test_the_clash_names_both_whichever_registers_first(monkeypatch, first):
    @dataclass(frozen=True)
    class Other(NoOptions):
        server_lr: float = option(0.01, "another meaning", range="> 0")

    monkeypatch.setattr(registration, "_REGISTRY", {})
    options = {"aa-momentum": ServerMomentumOptions, "zz-other": Other}
    second = next(name for name in options if name != first)
    _register(first, options[first])
    with pytest.raises(OptionClashError) as info:
        _register(second, options[second])
    text = str(info.value)
    assert "method 'aa-momentum' declares 'server-lr' as ServerMomentumOptions" in text
    assert "method 'zz-other' declares 'server-lr' as" in text


def test_a_payload_kinds_key_and_a_string_key_have_one_default(scratch_registry):
    @dataclass(frozen=True)
    class OwnSeed(VeraOptions):
        projection_seed: int = redeclare(VeraOptions, "projection-seed", 7)

    strategy = type("SeedStrategy", (VeraStrategy,), {})
    with pytest.raises(OptionClashError, match="read by the clients"):
        register_method("own-seed", payload=VERA, summary="t", options=OwnSeed)(
            strategy
        )

    @dataclass(frozen=True)
    class FormA(NoOptions):
        solver_form: str = option("a", "a form")

    @dataclass(frozen=True)
    class FormB(NoOptions):
        solver_form: str = redeclare(FormA, "solver-form", "b")

    _register("form-a", FormA)
    with pytest.raises(OptionClashError, match="a string key has one default"):
        _register("form-b", FormB)
