"""The causal-LM task's pieces: encoding, evaluation, data, models, options.

Evaluation is checked against a per-example reference on a real (tiny,
random) GPT-2: the batched, padded perplexity against one-example-at-a-time
float64 cross-entropy, and the batched left-padded greedy answers against
unpadded one-at-a-time generation.
"""

from __future__ import annotations

import math

import datasets
import numpy as np
import pytest
import torch
from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel

from fedlr.adapters import LoraSettings, apply_lora, lora_layout
from fedlr.adapters.orientation import resolve_targets
from fedlr.adapters.sorf_vera import SorfVeraSettings, apply_sorf_vera
from fedlr.config.run import RunConfig
from fedlr.data import dataset_info, load_dataset
from fedlr.data.hub import alpaca_rows, gsm8k_rows
from fedlr.data.instruct_text import exact_match, extract_answer
from fedlr.errors import ConfigError
from fedlr.models.causal import build_causal_lm, load_causal_tokenizer
from fedlr.strategies.registry import resolve
from fedlr.tasks.lm import IGNORE, encode_instructions, evaluate_lm
from fedlr.tasks.text import CausalLMTask, TextTask, text_task

TEMPLATE = "### Instruction:\n{instruction}\n\n### Response:\n"
ROWS = [
    {"instruction": "Add 12 and 30.", "response": "42"},
    {"instruction": "Which is larger, 7 or 9?", "response": "9"},
    {"instruction": "Tom has 3 bags of 4 apples. How many apples?", "response": "12"},
]


@pytest.fixture(scope="module")
def tok():
    return load_causal_tokenizer("tiny-gpt2")


@pytest.fixture(scope="module")
def gpt2(tok):
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=len(tok), n_embd=32, n_layer=2, n_head=2, n_positions=128
    )
    return GPT2LMHeadModel(config).eval()


# ---------------------------------------------------------------- encoding
def test_encoding_masks_the_prompt_and_pads_right_for_training(tok) -> None:
    data = encode_instructions(ROWS, tok, template=TEMPLATE, max_length=96)
    for i, row in enumerate(ROWS):
        prompt = data.prompts[i]
        ids, labels = data.input_ids[i], data.labels[i]
        assert ids[: len(prompt)] == prompt
        assert labels[: len(prompt)] == [IGNORE] * len(prompt)
        assert labels[len(prompt) :] == ids[len(prompt) :]
        assert ids[-1] == tok.eos_token_id
        response = tok.decode(ids[len(prompt) : -1])
        assert response == row["response"]
        assert data.answers[i] == row["response"]
    batch = data.batch([0, 1, 2])
    width = max(len(r) for r in data.input_ids)
    assert batch["input_ids"].shape == (3, width)
    for j in range(3):
        n = len(data.input_ids[j])
        assert batch["attention_mask"][j].tolist() == [1] * n + [0] * (width - n)
        assert (batch["labels"][j, n:] == IGNORE).all()
    prompts = data.prompt_batch([0, 1, 2])
    pw = max(len(p) for p in data.prompts)
    for j in range(3):
        n = len(data.prompts[j])
        assert prompts["attention_mask"][j].tolist() == [0] * (pw - n) + [1] * n
        assert prompts["input_ids"][j, pw - n :].tolist() == data.prompts[j]


def test_a_prompt_longer_than_max_length_is_refused_by_row(tok) -> None:
    with pytest.raises(ValueError, match=r"row 0: the prompt has \d+ tokens"):
        encode_instructions(ROWS, tok, template=TEMPLATE, max_length=8)


def test_gsm8k_answers_are_scored_after_the_marker() -> None:
    assert extract_answer("She pays 3 * 4 = 12.\n#### 1,212\nmore") == "1212"
    assert extract_answer("\n  42.\nthen") == "42"
    assert exact_match(" Maya\n", "maya")
    assert not exact_match("421", "42")


# -------------------------------------------------------------- evaluation
def test_evaluation_matches_one_example_at_a_time(tok, gpt2) -> None:
    data = encode_instructions(ROWS, tok, template=TEMPLATE, max_length=96)
    got = evaluate_lm(
        gpt2,
        data,
        tok,
        batch_size=2,
        device=torch.device("cpu"),
        max_new_tokens=5,
    )
    nll, count, hits = 0.0, 0, 0
    model64 = GPT2LMHeadModel(gpt2.config).eval()
    model64.load_state_dict(gpt2.state_dict())
    model64 = model64.double()
    with torch.no_grad():
        for i in range(len(ROWS)):
            ids = torch.tensor([data.input_ids[i]])
            labels = torch.tensor(data.labels[i][1:])
            logits = model64(input_ids=ids).logits[0, :-1]
            keep = labels != IGNORE
            nll += float(
                torch.nn.functional.cross_entropy(
                    logits[keep], labels[keep], reduction="sum"
                )
            )
            count += int(keep.sum())
            prompt = torch.tensor([data.prompts[i]])
            out = gpt2.generate(
                input_ids=prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=5,
                do_sample=False,
                pad_token_id=data.pad_id,
                eos_token_id=tok.eos_token_id,
            )
            text = tok.decode(out[0, prompt.shape[1] :], skip_special_tokens=True)
            hits += exact_match(text, data.answers[i])
    assert got["loss"] == pytest.approx(nll / count, rel=1e-5)
    assert got["perplexity"] == pytest.approx(math.exp(nll / count), rel=1e-5)
    assert got["exact-match"] == got["accuracy"] == hits / len(ROWS)


def test_greedy_answers_do_not_depend_on_left_padding(tok, gpt2) -> None:
    data = encode_instructions(ROWS, tok, template=TEMPLATE, max_length=96)
    batch = data.prompt_batch([0, 1, 2])
    with torch.no_grad():
        padded = gpt2.generate(
            **batch,
            max_new_tokens=4,
            do_sample=False,
            pad_token_id=data.pad_id,
            eos_token_id=tok.eos_token_id,
        )[:, batch["input_ids"].shape[1] :]
        for j in range(3):
            alone = torch.tensor([data.prompts[j]])
            single = gpt2.generate(
                input_ids=alone,
                attention_mask=torch.ones_like(alone),
                max_new_tokens=4,
                do_sample=False,
                pad_token_id=data.pad_id,
                eos_token_id=tok.eos_token_id,
            )[0, alone.shape[1] :]
            n = len(single)
            assert padded[j, :n].tolist() == single.tolist()


# -------------------------------------------------------------------- data
def test_arith_instruct_holds_out_exactly_its_test_problems() -> None:
    spec = dataset_info("arith-instruct")
    assert spec.kind == "instruct" and spec.offline and spec.num_classes == 6
    config = RunConfig(
        dataset="arith-instruct", model="tiny-llama", num_partitions=4, seed=1
    )
    task = text_task(config)
    assert isinstance(task, CausalLMTask)
    split = task.split()
    ds = load_dataset("arith-instruct", seed=1)
    tests = int(np.sum(np.asarray(ds["split"]) == "test"))
    assert len(split.heldout) == tests > 0
    assert set(split.heldout["split"]) == {"test"}
    held = {(r["family"], r["operation"], tuple(r["operands"])) for r in split.heldout}
    for pid in range(4):
        part = split.partition(pid)
        assert set(part["split"]) == {"train"}
        problems = {(r["family"], r["operation"], tuple(r["operands"])) for r in part}
        assert not problems & held


def test_hub_instruction_converters_keep_the_schema() -> None:
    alpaca = datasets.Dataset.from_dict(
        {
            "instruction": ["Name a colour.", "Translate to French."],
            "input": ["", "cat"],
            "output": ["Blue.", "chat"],
        }
    )
    rows = alpaca_rows(alpaca, "train")
    assert rows["instructions"] == ["Name a colour.", "Translate to French.\n\ncat"]
    assert rows["answers"] == ["Blue.", "chat"]
    gsm = datasets.Dataset.from_dict(
        {
            "question": ["Tom has 2 bags of 3. How many?"],
            "answer": ["2 * 3 = <<2*3=6>>6\n#### 6"],
        }
    )
    rows = gsm8k_rows(gsm, "test")
    assert rows["answers"] == ["6"] and rows["splits"] == ["test"]
    assert rows["responses"][0].endswith("#### 6")


# ------------------------------------------------------------------ models
def test_auto_targets_pick_each_architectures_attention_projections() -> None:
    bert = BertModel(
        BertConfig(
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=16,
        )
    )
    assert resolve_targets(bert, ("auto",)) == ("query", "value")
    llama = build_causal_lm("tiny-llama", 0)
    assert resolve_targets(llama, ("auto",)) == ("q_proj", "v_proj")
    gpt2 = build_causal_lm("tiny-gpt2", 0)
    assert resolve_targets(gpt2, ("auto",)) == ("c_attn",)
    assert resolve_targets(gpt2, ("c_fc",)) == ("c_fc",)
    with pytest.raises(ConfigError, match="target-modules"):
        resolve_targets(torch.nn.Sequential(torch.nn.Linear(2, 2)), ("auto",))


def test_all_linear_adapts_every_linear_layer_but_the_output() -> None:
    llama = build_causal_lm("tiny-llama", 0)
    model = apply_lora(
        llama,
        LoraSettings(rank=2, target_modules=("all-linear",), head_modules=()),
    )
    names = {m.name.rsplit(".", 1)[-1] for m in lora_layout(model).modules}
    assert names == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }
    assert len(lora_layout(model).modules) == 7 * llama.config.num_hidden_layers
    assert not lora_layout(model).head_shapes
    gpt2 = apply_lora(
        build_causal_lm("tiny-gpt2", 0),
        LoraSettings(rank=2, target_modules=("all-linear",), head_modules=()),
    )
    assert all(m.fan_in_fan_out for m in lora_layout(gpt2).modules)
    sorf = apply_sorf_vera(
        build_causal_lm("tiny-llama", 0),
        SorfVeraSettings(rank=4, target_modules=("all-linear",), head_modules=()),
    )
    sorf_names = {m.name.rsplit(".", 1)[-1] for m in sorf.modules}
    assert sorf_names == names and len(sorf.modules) == len(lora_layout(model).modules)


def test_the_offline_decoders_are_the_same_on_every_build() -> None:
    a, b = build_causal_lm("tiny-llama", 0), build_causal_lm("tiny-llama", 5)
    for (ka, va), (kb, vb) in zip(
        a.state_dict().items(), b.state_dict().items(), strict=True
    ):
        assert ka == kb and torch.equal(va, vb)
    c, d = build_causal_lm("tiny-gpt2", 7), build_causal_lm("tiny-gpt2", 7)
    pairs = zip(c.parameters(), d.parameters(), strict=True)
    assert all(torch.equal(x, y) for x, y in pairs)


# ----------------------------------------------------------------- options
@pytest.mark.parametrize(
    ("overrides", "key", "text"),
    [
        ({"model": "minilm"}, "model", "is an encoder classifier"),
        ({"dataset": "polarity", "model": "tiny-llama"}, "model", "is a decoder"),
        ({"dataset": "mnist"}, "dataset", "not a text data set"),
    ],
)
def test_a_model_of_the_other_task_is_a_config_error(overrides, key, text) -> None:
    config = RunConfig(
        **{
            "dataset": "arith-instruct",
            "model": "tiny-llama",
            **{k.replace("-", "_"): v for k, v in overrides.items()},
        }
    )
    with pytest.raises(ConfigError, match=text) as info:
        text_task(config)
    assert info.value.key == key


def test_text_task_is_unchanged_for_classification() -> None:
    assert isinstance(text_task(RunConfig()), TextTask)


@pytest.mark.parametrize(
    ("values", "key", "text"),
    [
        ({"precision": "fp8"}, "precision", "not one of"),
        ({"quantization": "2bit"}, "quantization", "not one of"),
        ({"max-new-tokens": 0}, "max-new-tokens", r"\[1, 1024\]"),
        ({"prompt-template": "Q: {question}"}, "prompt-template", "instruction"),
    ],
)
def test_bad_lm_options_are_named(values, key, text) -> None:
    with pytest.raises(ConfigError, match=text) as info:
        resolve(values)
    assert info.value.key == key


@pytest.mark.parametrize("method", ["fedex-lora", "vera-fedex", "flora"])
def test_folding_methods_refuse_a_quantised_base(method: str) -> None:
    with pytest.raises(ConfigError, match="folds each round's residual") as info:
        resolve({"method": method, "quantization": "4bit"})
    assert info.value.key == "quantization"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_a_quantised_base_without_cuda_says_why() -> None:
    with pytest.raises(ConfigError, match="needs CUDA") as info:
        build_causal_lm("tiny-llama", 0, quantization="8bit")
    assert info.value.key == "quantization"
