"""The architecture fixtures (fixtures/megatron_arch/, fixtures/gen/megatron_arch_fixtures.py)
hold what the Megatron <-> Hugging Face conversion tests compare with, so they are checked
against the transformers the test venv has: every `hf/` folder loads with
`AutoModelForCausalLM.from_pretrained` and gives its recorded logits, and every Megatron case's
`hf_config.json` is a config transformers accepts for the architecture the case names, with the
vocabulary of megatron's logits."""

import json
from pathlib import Path

import pytest
import safetensors.torch
import torch

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[3]
FX = ROOT / "fixtures" / "megatron_arch"
HF = sorted(p for p in (FX / "hf").iterdir() if (p / "config.json").is_file())
MEGATRON = sorted(p for p in FX.iterdir() if (p / "case.json").is_file())
TOL = 1e-4


def test_the_fixture_folders_are_there():
    assert {p.name for p in HF} >= {"llama", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe"}
    assert {p.name for p in MEGATRON} >= {"llama_tp2pp2", "llama_tied_tp2", "qwen2_tp2", "qwen3_tp2"}


@pytest.mark.parametrize("folder", HF, ids=lambda p: p.name)
def test_each_hf_folder_gives_its_recorded_logits(folder):
    rec = safetensors.torch.load_file(folder / "logits.safetensors")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        got = model.eval()(input_ids=rec["input_ids"]).logits.float()
    assert got.shape == rec["logits"].shape
    assert (got - rec["logits"]).abs().max().item() < TOL


@pytest.mark.parametrize("case", MEGATRON, ids=lambda p: p.name)
def test_each_megatron_case_names_a_config_transformers_accepts(case):
    meta = json.loads((case / "case.json").read_text())
    cfg = transformers.AutoConfig.for_model(**json.loads((case / "hf_config.json").read_text()))
    assert cfg.architectures == [meta["hf_architecture"]]
    assert cfg.vocab_size == meta["padded_vocab_size"] == meta["saved_args"]["padded_vocab_size"]
    assert cfg.num_hidden_layers == meta["num_layers"] == meta["saved_args"]["num_layers"]
    assert cfg.tie_word_embeddings == meta["tied_embeddings"]
    logits = safetensors.torch.load_file(case / "logits.safetensors")
    assert list(logits["logits"].shape) == [2, 8, cfg.vocab_size]
    assert meta["hf_reference_max_abs_diff"] < TOL
