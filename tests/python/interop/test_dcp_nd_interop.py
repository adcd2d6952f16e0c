"""The `ckpt` binary on DCP checkpoints sharded on any dim, written by real torch 2.13.

The fixtures are `fixtures/dcp_nd/` (made by `fixtures/gen/dcp_nd_fixtures.py`; see its
README): tensor parallel with FSDP2 on a 2x2 mesh (`_StridedShard` and `(Shard(0), Shard(1))`),
pure tensor parallel on 4 ranks, HSDP with `Shard(1)`, bare `distribute_tensor` layouts of ten
dtypes with empty shards and a nested dict of non-tensor values, the same state written by
`dcp.async_save` and by a one-file-per-item `FileSystemWriter`, a one-process checkpoint of
strided (channels_last, transposed) tensors, and HuggingFaceStorageWriter shards with torch's
consolidated files.

For every DCP case:

- `ckpt merge` gives the references tensor for tensor (dtype, shape, bytes) and each non-tensor
  value as JSON text in `__metadata__`, keyed by its dotted name (a string stays a string:
  `"1e-8"`; a float stays a number: `1e-08`);
- `ckpt reshard --world-size M` (M = 1 and 3) gives a folder torch's own `dcp_to_torch_save`
  reads back to the same tensors and values (same Python types); for a representative subset
  the folder is also loaded by `torch.distributed.checkpoint.load` into an FSDP2 model on M gloo
  ranks (`dcp_check.py load`, 6-9 s each);
- `ckpt verify` exits 0 and `ckpt inspect --json` lists every tensor with its global shape.

For `hf_storage_w4`, `ckpt merge` of the shard folder into a folder gives torch's
`consolidate_safetensors_files` output byte for byte (file names, headers, data, index).

`dcp_check.py load` fills its model with a sentinel (-12345) that int8, uint8, bool and float8
cannot hold, so for those dtypes the load check covers the other tensors and the
`dcp_to_torch_save` comparison covers them all.
"""

import json
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from conftest import FIXTURES, ROOT, files_of, run_ckpt

ND = FIXTURES / "dcp_nd"
CHECK = ROOT / "tests" / "python" / "interop" / "dcp_check.py"
MANIFEST = json.loads((ND / "expected.json").read_text())["cases"]

DCP_CASES = ["tp_fsdp2_2x2", "tp_w4", "hsdp_shard1_2x2", "dtensor_dims_w4", "async_w4", "multifile_w4", "strided_w1"]

# (case, M) pairs whose resharded output is also loaded on M ranks by torch (time: ~8 s each)
TORCH_LOADS = {("tp_fsdp2_2x2", 3), ("hsdp_shard1_2x2", 1), ("tp_w4", 3), ("dtensor_dims_w4", 3), ("strided_w1", 1)}

# dtypes dcp_check.py's sentinel fits in
LOADABLE = {torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32}


def ckpt_dir(case):
    return ND / case / "checkpoint"


def combined(case):
    return MANIFEST[case]["layout"] == "combined"


def read_st(path, prefix=""):
    with safe_open(str(path), "pt") as f:
        return {prefix + k: f.get_tensor(k) for k in f.keys()}, (f.metadata() or {})


def expected_tensors(case):
    """Every tensor by its DCP flat key (`model.` / `optim.` kept for combined cases)."""
    d = ND / case
    if combined(case):
        got = read_st(d / "expected_model.safetensors", "model.")[0]
        got.update(read_st(d / "expected_optim.safetensors", "optim.")[0])
        return got
    return read_st(d / "expected_model.safetensors")[0]


def expected_values(case):
    """Every non-tensor leaf by its DCP flat key: {key: {"python_type", "value"}}."""
    d = ND / case
    if combined(case):
        leaves = json.loads((d / "expected_optim.json").read_text())["non_tensor_leaves"]
        return {f"optim.{k}": v for k, v in leaves.items()}
    path = d / "expected_values.json"
    return json.loads(path.read_text()) if path.exists() else {}


def assert_same_tensors(got, want, what):
    assert sorted(got) == sorted(want), f"{what}: keys differ: {sorted(set(got) ^ set(want))[:8]}"
    for k in want:
        assert got[k].dtype == want[k].dtype, f"{what}: {k} dtype {got[k].dtype} != {want[k].dtype}"
        assert tuple(got[k].shape) == tuple(want[k].shape), f"{what}: {k} shape {list(got[k].shape)} != {list(want[k].shape)}"
        a = got[k].contiguous().reshape(-1).view(torch.uint8)
        b = want[k].contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(a, b), f"{what}: {k} bytes differ"


def as_json(v):
    if isinstance(v, (tuple, list)):
        return [as_json(x) for x in v]
    return v


def check_value(what, key, value, want):
    """`value` (a parsed JSON value) is the leaf `want` describes, with a JSON type that keeps its
    Python type apart (a str is never a number, a float never an int, a bool never an int)."""
    assert value == want["value"], f"{what}: {key} = {value!r}, want {want['value']!r}"
    kinds = {"str": (str,), "float": (float,), "int": (int,), "bool": (bool,), "NoneType": (type(None),),
             "tuple": (list,), "list": (list,)}
    ok = isinstance(value, kinds[want["python_type"]])
    if want["python_type"] in ("int", "float"):
        ok = ok and not isinstance(value, bool)
    assert ok, f"{what}: {key} is {type(value).__name__} in JSON, was a Python {want['python_type']}"


def torch_read(dcp_dir, tmp_path):
    """dcp_to_torch_save + torch.load: flat key -> tensor, flat key -> other value."""
    pt = tmp_path / "torch_read.pt"
    dcp_to_torch_save(str(dcp_dir), str(pt))
    flat = flatten_state_dict(torch.load(pt, weights_only=True))[0]
    pt.unlink()
    return ({k: v for k, v in flat.items() if torch.is_tensor(v)},
            {k: v for k, v in flat.items() if not torch.is_tensor(v)})


def dcp_check(*args):
    proc = subprocess.run([sys.executable, str(CHECK), *map(str, args)], capture_output=True, text=True)
    assert proc.returncode == 0, f"dcp_check {args[0]} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return proc.stdout


# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", DCP_CASES)
def test_merge_matches_references(tmp_path, case):
    out = tmp_path / "merged.safetensors"
    run_ckpt("merge", ckpt_dir(case), out)
    got, meta = read_st(out)
    assert_same_tensors(got, expected_tensors(case), f"ckpt merge {case}")
    want = expected_values(case)
    values = {k: v for k, v in meta.items() if k != "format"}
    assert sorted(values) == sorted(want), f"non-tensor keys differ: {sorted(set(values) ^ set(want))}"
    for k, text in values.items():
        check_value(f"ckpt merge {case}", k, json.loads(text), want[k])
    if case == "dtensor_dims_w4":
        # the pair the fixture exists for: one is text, the other a number
        assert json.loads(values["extra.eps_str"]) == "1e-8"
        eps = json.loads(values["extra.eps"])
        assert isinstance(eps, float) and eps == 1e-08


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("case", DCP_CASES)
def test_reshard_reads_back_in_torch(tmp_path, case, m):
    out = tmp_path / f"w{m}"
    run_ckpt("reshard", ckpt_dir(case), out, "--world-size", m)
    assert (out / ".metadata").is_file()
    tensors, values = torch_read(out, tmp_path)
    assert_same_tensors(tensors, expected_tensors(case), f"reshard {case} to {m}, read by torch")
    want = expected_values(case)
    assert sorted(values) == sorted(want)
    for k, v in values.items():
        check_value(f"reshard {case} to {m}", k, as_json(v), want[k])
        assert type(v).__name__ == want[k]["python_type"], f"{k}: {type(v).__name__} after reshard"

    if (case, m) in TORCH_LOADS:
        ref = ND / case / "expected_model.safetensors"
        tensors, meta = read_st(ref)
        if any(t.dtype not in LOADABLE for t in tensors.values()):
            keep = {k: t for k, t in tensors.items() if t.dtype in LOADABLE}
            ref = tmp_path / "loadable.safetensors"
            save_file(keep, str(ref), metadata={"format": "pt", "statekit.buffers": json.dumps(
                [b for b in json.loads(meta.get("statekit.buffers", "[]")) if b in keep])})
        where = ["--key", "model"] if combined(case) else ["--no-key"]
        dcp_check("load", out, "--world-size", m, *where, "--reference", ref)


@pytest.mark.parametrize("case", DCP_CASES)
def test_verify_and_inspect(case):
    run_ckpt("verify", ckpt_dir(case))
    doc = json.loads(run_ckpt("inspect", ckpt_dir(case), "--json").stdout)
    listed = {t["name"]: list(t["shape"]) for t in doc["tensors"]}
    want = {k: e["global_shape"] for k, e in MANIFEST[case]["tensors"].items() if e["type"] == "tensor"}
    assert sorted(listed) == sorted(want), f"tensors differ: {sorted(set(listed) ^ set(want))[:8]}"
    for k, shape in want.items():
        assert listed[k] == shape, f"{k}: inspect says {listed[k]}, the checkpoint's global shape is {shape}"


def test_merge_hf_storage_matches_consolidate(tmp_path):
    """HuggingFaceStorageWriter(save_distributed=True) shards (12 files, 4 ranks x 3 output files,
    no `.metadata`) merged into a folder: torch's consolidated files, byte for byte.

    consolidate_safetensors_files lists each file's tensors in the order of the mapping it is
    given, which is not on disk. `expected_consolidated/` had the mapping in the state dict's
    order, the order the shards' DCP_SHARDING_INFO carries; `expected_consolidated_by_name/` (the
    mapping listed by name) holds the same tensors in the same files, in another order."""
    case = ND / "hf_storage_w4"
    out = tmp_path / "consolidated"
    run_ckpt("merge", case / "checkpoint", out)
    got, want = files_of(out), files_of(case / "expected_consolidated")
    assert sorted(got) == sorted(want)
    for name, data in want.items():
        assert got[name] == data, f"{name} differs from consolidate_safetensors_files' output"
    for name in want:
        if name.endswith(".safetensors"):
            assert_same_tensors(read_st(out / name)[0], read_st(case / "expected_consolidated_by_name" / name)[0],
                                f"{name} against the by-name consolidation")


@pytest.mark.parametrize("case", ["tp_fsdp2_2x2", "dtensor_dims_w4"])
def test_convert_to_torch_and_split_to_hub_shards(tmp_path, case):
    """Boxes on any dims go to every output: a `torch.save` file that torch's weights-only loader
    reads, and huggingface_hub's sharded layout that safetensors reads, both equal to the
    references."""
    want = expected_tensors(case)
    pt = tmp_path / "model.bin"
    run_ckpt("convert", ckpt_dir(case), pt)
    got = {k: v for k, v in torch.load(pt, weights_only=True).items() if torch.is_tensor(v)}
    assert_same_tensors(got, want, f"{case}: convert to torch")
    shards = tmp_path / "shards"
    run_ckpt("split", ckpt_dir(case), shards, "--max-shard-size", "256")
    index = json.loads((shards / "model.safetensors.index.json").read_text())
    got = {}
    for name in sorted(set(index["weight_map"].values())):
        got.update(read_st(shards / name)[0])
    assert_same_tensors(got, want, f"{case}: split into hub shards")
