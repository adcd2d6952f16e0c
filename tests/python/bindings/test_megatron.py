"""statekit.ckpt (the installed package) on the Megatron-Core checkpoints that real megatron-core
wrote (fixtures/megatron/; fixtures/gen/megatron_fixtures.py, megatron_train_fixtures.py): `inspect` names the format and
tells the run and model that case.json describes; `merge` gives megatron's own one-rank
state_dict (`expected_model.safetensors`, what `dist_checkpointing.load` at TP 1 x PP 1 filled
in), bit for bit; `as_stored=True` gives what torch's `dcp_to_torch_save` gives
(`expected_stored.safetensors`); and `as_stored` is refused for any other format.

A case is every folder of fixtures/megatron/ with a `case.json` (which the generators write last):
its checkpoint is the `ckpt/` folder, or the Megatron-LM run folder (the one holding
`latest_checkpointed_iteration.txt`); a `case.json` with `forms` (one training run saved in
several forms: `train_dp2/dp_reshardable`, ...) is one case per form, each its own run folder
and `expected_stored`. `expected_model.safetensors` is required; the `as_stored` comparison runs
for every case that has its expected stored tensors. A new case is covered without an edit here,
and a folder with a `case.json` that gives no case fails `test_every_case_folder_is_read`."""

import json
from pathlib import Path

import pytest
import safetensors.torch
import torch

from statekit import ckpt
from statekit.errors import BadOption

ROOT = Path(__file__).resolve().parents[3]
FX = ROOT / "fixtures" / "megatron"
TRACKER = "latest_checkpointed_iteration.txt"


def run_or_ckpt(case_dir: Path):
    """The path to open: the run folder when there is one (resolved through its tracker), else
    the `ckpt/` folder."""
    if (case_dir / TRACKER).is_file():
        return case_dir
    ckpt_dir = case_dir / "ckpt"
    return ckpt_dir if ckpt_dir.is_dir() else None


def discover():
    """Case id -> (source, case.json, expected model, expected stored or None, the optimizer
    form the checkpoint holds or None)."""
    found = {}
    if not FX.is_dir():
        return found
    for d in sorted(p for p in FX.iterdir() if p.is_dir() and (p / "case.json").is_file()):
        case = json.loads((d / "case.json").read_text())
        model = d / case.get("expected_model", "expected_model.safetensors")
        if "forms" in case:
            for form, f in sorted(case["forms"].items()):
                found[f"{d.name}/{form}"] = (d / f["run_dir"], case, model, d / f["expected_stored"], form)
        else:
            found[d.name] = (run_or_ckpt(d), case, model, d / "expected_stored.safetensors", None)
    return {
        k: (src, case, model, stored if stored.is_file() else None, form)
        for k, (src, case, model, stored, form) in found.items()
        if src is not None and src.is_dir() and model.is_file()
    }


CASE_INFO = discover()
CASES = sorted(CASE_INFO)
STORED_CASES = [c for c in CASES if CASE_INFO[c][3] is not None]


def source(name):
    return CASE_INFO[name][0]


def case_of(name):
    return CASE_INFO[name][1]


def expected_model(name):
    return safetensors.torch.load_file(CASE_INFO[name][2])


def expected_stored(name):
    return safetensors.torch.load_file(CASE_INFO[name][3])


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes (a 0-dim tensor has no `view(uint8)` of its own)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_same_names(got, want, what: str):
    got, want = sorted(got), sorted(want)
    assert got == want, f"{what}: only in ours: {sorted(set(got) - set(want))}; only in the reference: {sorted(set(want) - set(got))}"


def assert_same_tensors(got: dict, want: dict, what: str):
    assert_same_names(got, want, what)
    for k in want:
        g, w = got[k], want[k]
        assert g.dtype == w.dtype, f"{what}: `{k}` is {g.dtype}, expected {w.dtype}"
        assert tuple(g.shape) == tuple(w.shape), f"{what}: `{k}` has shape {tuple(g.shape)}, expected {tuple(w.shape)}"
        assert torch.equal(byte_view(g), byte_view(w)), f"{what}: `{k}` differs"


def test_every_case_folder_is_read():
    # An empty parameter list would skip every test below without a word, and a case folder in
    # a layout `discover` does not know would be left out.
    assert CASES, f"no Megatron case under {FX} (a checkpoint, expected_model.safetensors and case.json)"
    assert STORED_CASES, f"no Megatron case under {FX} has its expected stored tensors"
    folders = sorted(p.name for p in FX.iterdir() if (p / "case.json").is_file())
    read = sorted({c.split("/")[0] for c in CASES})
    assert read == folders, f"case folders giving no case: {sorted(set(folders) - set(read))}"


# -- inspect --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CASES)
def test_inspect_names_the_format_and_tells_the_run_and_model(name):
    case = case_of(name)
    src = source(name)
    info = ckpt.inspect(src)
    legacy = case.get("ckpt_format") == "torch"
    assert info.format == ("megatron-legacy" if legacy else "megatron-torch-dist")
    m = info.megatron
    assert m is not None, "inspect gives no `megatron` info"
    assert m == info.document["megatron"]
    assert m["layout"] == ("legacy" if legacy else "torch_dist")
    assert m["iteration"] == case.get("iteration")
    # What the tensors themselves tell: every checkpoint gives these.
    assert m["num_layers"] == case["layers"]
    assert m["hidden_size"] == case["hidden"]
    assert m["tied_embeddings"] == case["tied"]
    # What only Megatron-LM's saved `args` tell: a run folder (`save_checkpoint`) has them; a
    # bare `dist_checkpointing.save` folder may not, and then they are None, never a guess.
    from_args = {
        "tensor_parallel": case["tp"],
        "pipeline_parallel": case["pp"],
        "ffn_hidden_size": case["ffn"],
        "num_attention_heads": case["heads"],
        "num_query_groups": case["query_groups"],
        "swiglu": case["swiglu"],
    }
    has_args = (src / TRACKER).is_file()
    for key, want in from_args.items():
        if has_args:
            assert m[key] == want, f"`{key}` is {m[key]!r}, case.json says {want!r}"
        else:
            assert m[key] in (None, want), f"`{key}` is {m[key]!r}, case.json says {want!r}"
    # The distributed optimizer's form, where the checkpoint holds one.
    assert m["optimizer"] == CASE_INFO[name][4]
    # The one-rank model's tensors, as merge writes them.
    want = expected_model(name)
    assert_same_names([t.name for t in info.tensors], want, f"{name}: inspect")
    assert info.total_bytes == sum(t.numel() * t.element_size() for t in want.values())


@pytest.mark.parametrize("name", STORED_CASES)
def test_inspect_as_stored_lists_the_stored_keys(name):
    info = ckpt.inspect(source(name), as_stored=True)
    assert info.format == "megatron-torch-dist"
    assert info.megatron == ckpt.inspect(source(name)).megatron
    want = expected_stored(name)
    assert_same_names([t.name for t in info.tensors], want, f"{name}: inspect as_stored")


# -- merge and load: megatron's own tensors, bit for bit -------------------------------------


@pytest.mark.parametrize("name", CASES)
def test_merge_equals_megatrons_one_rank_state_dict(name, tmp_path):
    out = tmp_path / "model.safetensors"
    o = ckpt.merge(source(name), out)
    want = expected_model(name)
    assert o.tensors == len(want)
    assert_same_tensors(safetensors.torch.load_file(out), want, f"{name}: merge")


@pytest.mark.parametrize("name", STORED_CASES)
def test_merge_as_stored_equals_dcp_to_torch_save(name, tmp_path):
    out = tmp_path / "stored.safetensors"
    o = ckpt.merge(source(name), out, as_stored=True)
    want = expected_stored(name)
    assert o.tensors == len(want)
    assert_same_tensors(safetensors.torch.load_file(out), want, f"{name}: merge as_stored")


@pytest.mark.parametrize("name", STORED_CASES)
@pytest.mark.parametrize("as_stored", [False, True], ids=["model", "as_stored"])
def test_load_and_convert_give_the_same_tensors(name, as_stored, tmp_path):
    want = expected_stored(name) if as_stored else expected_model(name)
    src = source(name)
    got = ckpt.load(src, framework="torch", as_stored=as_stored)
    assert_same_tensors(dict(got), want, f"{name}: load")
    out = tmp_path / "c.safetensors"
    ckpt.convert(src, out, as_stored=as_stored)
    assert_same_tensors(safetensors.torch.load_file(out), want, f"{name}: convert")
    report = ckpt.verify(src, as_stored=as_stored)
    assert report.valid, report.problems
    assert report.tensors == len(want)


# -- the distributed optimizer ---------------------------------------------------------------

OPTIMIZER_CASES = [c for c in CASES if CASE_INFO[c][4] is not None]


@pytest.mark.parametrize("name", OPTIMIZER_CASES)
def test_merge_optimizer_gives_the_per_parameter_state(name, tmp_path):
    """Either form, no option to say which: the `fully_reshardable` save gives what megatron
    stored; the `dp_reshardable` one the optimizer's live state, the same tensors unless megatron
    0.19.2's `fully_reshardable` save shifted some (its bucket-padding bug; the generator then
    writes `expected_optimizer_live.safetensors` beside the stored `expected_optimizer`)."""
    assert OPTIMIZER_CASES, "no training save with the distributed optimizer"
    case_dir = CASE_INFO[name][2].parent
    live = case_dir / "expected_optimizer_live.safetensors"
    stored = case_dir / "expected_optimizer.safetensors"
    want_file = live if CASE_INFO[name][4] == "dp_reshardable" and live.is_file() else stored
    out = tmp_path / "model.safetensors"
    o = ckpt.merge(source(name), out, optimizer=True)
    got = safetensors.torch.load_file(tmp_path / "optimizer.safetensors")
    want = safetensors.torch.load_file(want_file)
    assert_same_tensors(got, want, f"{name}: merge optimizer")
    assert o.tensors == len(expected_model(name)) + len(want)


@pytest.mark.parametrize("case", ["legacy_tp2pp2", "legacy_dp2_distopt"])
def test_merge_optimizer_of_a_legacy_save(case, tmp_path):
    """Legacy saves, without the distributed optimizer (each rank's state by index and its fp32
    master copies) and with it (`distrib_optim.pt`): per parameter, named as the
    `fully_reshardable` form names them."""
    case_dir = FX / case
    ckpt.merge(case_dir, tmp_path / "model.safetensors", optimizer=True)
    got = safetensors.torch.load_file(tmp_path / "optimizer.safetensors")
    want = safetensors.torch.load_file(case_dir / "expected_optimizer.safetensors")
    assert_same_tensors(got, want, f"{case}: merge optimizer")


# -- as_stored elsewhere ---------------------------------------------------------------------

SAFETENSORS = ROOT / "fixtures" / "safetensors" / "model_single" / "model.safetensors"


def opening_calls(tmp_path):
    """Every statekit.ckpt function that opens a source, on `src` with `as_stored=True`."""
    return {
        "inspect": lambda src: ckpt.inspect(src, as_stored=True),
        "load": lambda src: ckpt.load(src, as_stored=True),
        "verify": lambda src: ckpt.verify(src, as_stored=True),
        "merge": lambda src: ckpt.merge(src, tmp_path / "m.safetensors", as_stored=True),
        "split": lambda src: ckpt.split(src, tmp_path / "split", as_stored=True),
        "convert": lambda src: ckpt.convert(src, tmp_path / "c.safetensors", as_stored=True),
        "reshard": lambda src: ckpt.reshard(src, tmp_path / "r", 2, as_stored=True),
    }


@pytest.mark.parametrize("call", sorted(opening_calls(Path("."))))
def test_as_stored_is_refused_for_other_formats(call, tmp_path):
    with pytest.raises(BadOption, match=r"`as_stored`.*Megatron `torch_dist` checkpoints only") as e:
        opening_calls(tmp_path)[call](SAFETENSORS)
    assert isinstance(e.value, ValueError)
    assert not any(tmp_path.iterdir()), "nothing is written when an option is refused"



def test_convert_to_hf_writes_the_hub_folder_the_cli_writes(tmp_path):
    """`ckpt.convert(src, out, to="hf")` is `ckpt convert SRC OUT --to hf`: a `config.json` and
    the Hub-named tensors, here of a tied Llama run with its padded vocabulary cut to 30 rows."""
    src = ROOT / "fixtures" / "megatron" / "legacy_tp2pp2"
    out = tmp_path / "hf"
    done = ckpt.convert(src, out, to="hf", arch="llama", vocab_size=30)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert done.tensors == 2 + 4 * 9
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["vocab_size"], config["tie_word_embeddings"]) == ("llama", 30, True)
    written = safetensors.torch.load_file(out / "model.safetensors")
    merged = safetensors.torch.load_file(src / "expected_model.safetensors")
    assert "lm_head.weight" not in written
    assert torch.equal(written["model.embed_tokens.weight"], merged["embedding.word_embeddings.weight"][:30])
    gate, up = merged["decoder.layers.2.mlp.linear_fc1.weight"].chunk(2)
    assert torch.equal(written["model.layers.2.mlp.gate_proj.weight"], gate)
    assert torch.equal(written["model.layers.2.mlp.up_proj.weight"], up)
    with pytest.raises(BadOption, match=r"`arch` only applies to `to=\"hf\"`"):
        ckpt.convert(src, tmp_path / "x.safetensors", arch="llama")


def test_convert_to_megatron_legacy_cuts_the_ranks_the_cli_cuts(tmp_path):
    """`ckpt.convert(src, out, to="megatron-legacy", tensor_parallel=2, pipeline_parallel=2)` is
    the CLI's `--to megatron-legacy --tensor-parallel 2 --pipeline-parallel 2`: megatron's four
    rank files, each rank's pieces of megatron's one-rank tensors as its parallel layers cut
    them (rows of the column-parallel, columns of the row-parallel), local layer numbers, the
    tied embeddings copied to the last stage, and each linear's `_extra_state`."""
    src = ROOT / "fixtures" / "megatron" / "legacy_tp2pp2"
    out = tmp_path / "legacy"
    done = ckpt.convert(src, out, to="megatron-legacy", tensor_parallel=2, pipeline_parallel=2)
    it = out / "iter_0000001"
    ranks = ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    assert sorted(p.name for p in it.iterdir()) == ranks
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "1"
    saved = {r: torch.load(it / r / "model_optim_rng.pt", weights_only=False) for r in ranks}
    assert done.tensors == sum(not k.endswith("_extra_state") for r in ranks for k in saved[r]["model"])
    merged = safetensors.torch.load_file(src / "expected_model.safetensors")
    last = saved["mp_rank_01_001"]
    assert last["checkpoint_version"] == 3.0 and last["args"].tensor_model_parallel_size == 2
    model = last["model"]
    # Layers 2 and 3 are the last stage's 0 and 1; rank 1 holds the second half of each cut.
    fc2 = merged["decoder.layers.3.mlp.linear_fc2.weight"]
    assert torch.equal(model["decoder.layers.1.mlp.linear_fc2.weight"], fc2.chunk(2, dim=1)[1])
    gate, up = merged["decoder.layers.2.mlp.linear_fc1.weight"].chunk(2)
    assert torch.equal(model["decoder.layers.0.mlp.linear_fc1.weight"], torch.cat([gate.chunk(2)[1], up.chunk(2)[1]]))
    assert torch.equal(model["output_layer.weight"], merged["embedding.word_embeddings.weight"].chunk(2)[1])
    assert model["output_layer._extra_state"] is None and model["decoder.layers.0.mlp.linear_fc2._extra_state"] is None
    with pytest.raises(BadOption, match=r"`tensor_parallel` only applies to `to=\"megatron-legacy\"`"):
        ckpt.convert(src, tmp_path / "x", to="megatron", tensor_parallel=2)
