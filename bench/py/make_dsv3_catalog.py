"""A synthetic Megatron-LM `torch_dist` run of a DeepSeek-V3-sized mixture-of-experts model: every
byte that describes the checkpoint is real, the tensors' data bytes are holes (sparse files), so
the 1.35 TB run takes a few MB of disk. For timing what `ckpt` does before it copies anything
(`--dry-run`: open, catalog, plan) at the size of the largest open MoE models.

    PYTHONPATH=/opt/mcore python bench/py/make_dsv3_catalog.py OUT TEMPLATE_RUN [--no-expert-extra-state]
    PYTHONPATH=/opt/mcore python bench/py/make_dsv3_catalog.py --validate TEMPLATE_RUN

TEMPLATE_RUN is a small run megatron-core 0.19.2 wrote for real: bench/py/make_megatron_moe_checkpoint.py's
(a Qwen2-MoE-style GPTModel: dense first layer, MoE layers with a gated shared expert, QKV bias,
untied output layer, bf16; EP 2). PYTHONPATH must reach megatron (/opt/mcore) because its saved
`args` (an argparse.Namespace) are unpickled to be resized.

The model: DeepSeek-V3's sizes in a family statekit converts, not DeepSeek-V3's attention.
DeepSeek-V3 uses multi-latent attention, which no Hugging Face family of statekit's tables has (a
run with `multi_latent_attention` is refused by name), so this is a Qwen2-MoE-family model
(grouped-query attention, QKV bias, a shared expert with a sigmoid gate, dense layers where
`moe_layer_freq` says 0) at DeepSeek-V3's sizes: 61 layers, the first 3 dense (FFN 18432), then 58
MoE layers of 256 routed experts (FFN 2048, top 8, top-k probabilities renormalized, as
DeepSeek-V3 does; its sigmoid scores and expert bias are not expressible here either, so softmax)
plus one shared expert (FFN 2048), hidden 7168, 128 heads of dim 128 in 8 query groups, vocab
129280, untied output layer, RMSNorm, SwiGLU, rope, bf16. That is 675 B parameters (DeepSeek-V3:
671 B without its multi-token-prediction module; GQA attention here is larger than MLA).

The layout: what Megatron-LM would write for pipeline parallel 16 (`--decoder-first-pipeline-num-
layers 1`: stage 0 holds the embedding and layer 0, stages 1-15 four layers each, the last also
the final norm and output layer), data parallel 64, expert parallel 64 (4 experts per rank, expert
data parallel 1), tensor parallel 1: 1024 ranks, one `__R_0.distcp` per rank, rank = dp + 64 pp.
Each expert chunk lives in the file of the rank that holds the expert; the replicated tensors of a
stage are dealt to its 64 data-parallel ranks the way megatron's fully parallel save deals them
(largest first, each to the least loaded rank, counting the experts already there).

How the bytes are made:
- `.metadata` is torch's own `Metadata` object (the template run's, its fields replaced): tensor
  entries (TensorStorageMetadata, ChunkStorageMetadata), bytes entries (BytesStorageMetadata),
  the storage index (MetadataIndex -> _StorageInfo) and `all_local_plans`, every rank's SavePlan,
  which torch 2.13 keeps there; pickled as torch's FileSystemWriter pickles it.
- The keys, global shapes and chunk boxes follow megatron-core 0.19.2's sharded state dict of this
  model (per-layer keys, because the dense layers make the layers non-homogeneous; experts stacked
  on a global expert axis, `linear_fc1` saved as its gate and up halves). `--validate` checks the
  rule against the template run: generated for the template's sizes and layout, it must give the
  same keys, dtypes, global shapes and chunk boxes as megatron's own `.metadata`.
- Every item is a complete `torch.save` zip, as DCP writes them: a tensor item's bytes are
  `torch.save` of a zero tensor of the chunk's shape (made once per distinct shape, the zeros'
  CRC32 included), with the zero payload left as a hole in the data file. `--validate` checks
  these against the template's items: same records, offsets, sizes and `data.pkl`.
- The bytes items are real: `_extra_state` and `rng_state` items are the template run's bytes;
  `common_state` is the template's saved dict (`args`, `checkpoint_version` 3.0, `iteration`)
  with the model's and the layout's sizes set in `args`, `torch.save`d again.
`--no-expert-extra-state` leaves out the experts' `_extra_state` items (29,696 of the 29,957
non-tensor items; megatron writes them, one per expert and linear layer, each a pickled `[None]`
here), which is not what megatron writes: it exists to time the plan of the tensors where the
full folder is refused (statekit 75ecbae refuses it: the non-tensor items share one unpickling
budget, which these many small pickles exhaust; see bench/RESULTS-megatron-plan.md).

So `ckpt` sees what it would see in a real run of this shape, except that reading a tensor gives
zeros (their CRC32s are the zeros'). Nothing here writes the 1.35 TB.
`ckpt --dry-run` reads each item's zip records, and the last 64 KiB of each item (where a zip's
end record is looked for, which for a tensor item is mostly its payload's tail: holes here), never
the rest of a payload.
"""

import io
import json
import os
import pickle
import shutil
import sys
import uuid
import zipfile

import torch
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, MetadataIndex,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.filesystem import _StorageInfo

ITERATION = 2
# DeepSeek-V3's sizes (config.json of deepseek-ai/DeepSeek-V3), in a Qwen2-MoE-family model.
DSV3 = {"layers": 61, "dense_layers": 3, "hidden": 7168, "heads": 128, "query_groups": 8, "head_dim": 128,
        "ffn": 18432, "experts": 256, "topk": 8, "moe_ffn": 2048, "shared_ffn": 2048, "vocab": 129280,
        "seq_len": 4096, "norm_topk": True}
LAYOUT = {"pp": 16, "dp": 64, "ep": 64, "first_stage_layers": 1}


# ------------------------------------------------------------------------- the sharded state dict


def model_keys(c, expert_extra=True):
    """[(key, global shape, [(offsets, sizes)], module)] for the tensors, and [(key, module)] for
    the `_extra_state` items, of the model `c` as megatron-core 0.19.2 saves it at TP 1. `module`
    groups a weight with its extra state (and names the expert for expert items)."""
    H, V = c["hidden"], c["vocab"]
    q = c["heads"] * c["head_dim"]
    qkv = (c["heads"] + 2 * c["query_groups"]) * c["head_dim"]
    full = lambda shape: [((0,) * len(shape), tuple(shape))]
    halves = lambda rows, cols: [((0, 0), (rows, cols)), ((rows, 0), (rows, cols))]
    tensors = [("embedding.word_embeddings.weight", (V, H), full((V, H)), "embedding"),
               ("decoder.final_layernorm.weight", (H,), full((H,)), "final"),
               ("output_layer.weight", (V, H), full((V, H)), "output")]
    extra = []
    freq = c["layer_freq"]
    for n in range(c["layers"]):
        p = f"decoder.layers.{n}."
        tensors += [(p + "self_attention.linear_qkv.layer_norm_weight", (H,), full((H,)), p + "self_attention.linear_qkv"),
                    (p + "self_attention.linear_qkv.weight", (qkv, H), full((qkv, H)), p + "self_attention.linear_qkv"),
                    (p + "self_attention.linear_qkv.bias", (qkv,), full((qkv,)), p + "self_attention.linear_qkv"),
                    (p + "self_attention.linear_proj.weight", (H, q), full((H, q)), p + "self_attention.linear_proj"),
                    (p + "mlp.linear_fc1.layer_norm_weight", (H,), full((H,)), p + "mlp.linear_fc1")]
        extra += [(p + "self_attention.linear_proj._extra_state/shard_0_1", p + "self_attention.linear_proj"),
                  (p + "self_attention.linear_qkv._extra_state/shard_0_1", p + "self_attention.linear_qkv")]
        if not freq[n]:
            F = c["ffn"]
            tensors += [(p + "mlp.linear_fc1.weight", (2 * F, H), halves(F, H), p + "mlp.linear_fc1"),
                        (p + "mlp.linear_fc2.weight", (H, F), full((H, F)), p + "mlp.linear_fc2")]
            extra += [(p + "mlp.linear_fc1._extra_state/shard_0_1", p + "mlp.linear_fc1"),
                      (p + "mlp.linear_fc2._extra_state/shard_0_1", p + "mlp.linear_fc2")]
            continue
        E, f, s = c["experts"], c["moe_ffn"], c["shared_ffn"]
        x = p + "mlp.experts.experts."
        tensors += [(p + "mlp.router.weight", (E, H), full((E, H)), p + "mlp.router"),
                    (x + "linear_fc1.weight", (E, 2 * f, H),
                     [((e, h * f, 0), (1, f, H)) for e in range(E) for h in (0, 1)], x + "*"),
                    (x + "linear_fc2.weight", (E, H, f), [((e, 0, 0), (1, H, f)) for e in range(E)], x + "*"),
                    (p + "mlp.shared_experts.linear_fc1.weight", (2 * s, H), halves(s, H), p + "mlp.shared_experts.linear_fc1"),
                    (p + "mlp.shared_experts.linear_fc2.weight", (H, s), full((H, s)), p + "mlp.shared_experts.linear_fc2"),
                    (p + "mlp.shared_experts.gate_weight", (1, H), full((1, H)), p + "mlp.shared_experts.gate")]
        if expert_extra:
            extra += [(x + f"linear_fc{i}._extra_state/shard_{e}_{E}", x + f"{e}") for e in range(E) for i in (1, 2)]
        extra += [(p + "mlp.shared_experts.linear_fc1._extra_state/shard_0_1", p + "mlp.shared_experts.linear_fc1"),
                  (p + "mlp.shared_experts.linear_fc2._extra_state/shard_0_1", p + "mlp.shared_experts.linear_fc2")]
    return tensors, extra


def stage_of_layer(c, lay):
    """The pipeline stage of each layer: the first stage `first_stage_layers` (or an even share),
    the rest evenly."""
    pp, n = lay["pp"], c["layers"]
    first = lay.get("first_stage_layers") or n // pp
    rest = (n - first) // (pp - 1) if pp > 1 else 0
    return [0 if l < first else min(pp - 1, 1 + (l - first) // rest) for l in range(n)]


def place(c, lay, tensors, extra):
    """{rank: [item]} where an item is ("t", key, offsets, sizes) or ("b", key): which rank's file
    holds each chunk and bytes item (see the module docstring)."""
    pp, dp, ep = lay["pp"], lay["dp"], lay["ep"]
    local = c["experts"] // ep
    stages = stage_of_layer(c, lay)

    def stage_of(key):
        if key.startswith("decoder.layers."):
            return stages[int(key.split(".")[2])]
        return 0 if key.startswith("embedding.") else pp - 1

    ranks = {r: [] for r in range(pp * dp)}
    load = {r: 0 for r in ranks}
    home = {}  # module -> rank, for its extra state
    replicated = []
    for key, shape, chunks, module in tensors:
        s = stage_of(key)
        if module.endswith("*"):  # expert chunks: the rank holding the expert (expert data parallel 1)
            for off, size in chunks:
                r = s * dp + (off[0] // local)
                ranks[r].append(("t", key, off, size))
                load[r] += prod(size) * 2
            continue
        for off, size in chunks:
            replicated.append((prod(size) * 2, s, key, off, size, module))
    # megatron's distribute_shards_to_ranks: largest first, each to the least loaded rank of its group
    for nbytes, s, key, off, size, module in sorted(replicated, key=lambda t: (-t[0], t[2], t[3])):
        r = min(range(s * dp, (s + 1) * dp), key=lambda r: (load[r], r))
        ranks[r].append(("t", key, off, size))
        load[r] += nbytes
        home.setdefault(module, r)
    for key, module in extra:
        if key.startswith("decoder.layers.") and ".experts.experts." in key:
            e = int(key.rsplit("/shard_", 1)[1].split("_")[0])
            r = stages[int(key.split(".")[2])] * dp + e // local
        else:
            r = home[module]
        ranks[r].append(("b", key))
    ranks[0].append(("b", "common_state/shard_0_1"))
    for s in range(pp):
        ranks[s * dp].append(("b", f"rng_state/shard_{s}.0_{pp}.1"))
    return ranks


def prod(xs):
    n = 1
    for x in xs:
        n *= x
    return n


# ------------------------------------------------------------------------- item bytes


class Holes:
    """A file object for `torch.save` that leaves every all-zero write of 64 KiB or more as a
    hole: the zip records and CRCs are torch's, the zero payload costs no disk."""

    def __init__(self, f):
        self.f = f

    def write(self, b):
        mv = memoryview(b).cast("B")
        if len(mv) >= 1 << 16 and not torch.frombuffer(mv, dtype=torch.uint8).any():
            self.f.seek(len(mv), os.SEEK_CUR)
        else:
            self.f.write(mv)
        return len(mv)

    def flush(self):
        self.f.flush()


class Templates:
    """`torch.save` of a zero tensor of each chunk shape, made once: the bytes before the storage
    record's payload, its length, the bytes after it."""

    def __init__(self, tmp):
        self.tmp, self.cache = tmp, {}

    def get(self, sizes, dtype=torch.bfloat16):
        k = (tuple(sizes), dtype)
        if k not in self.cache:
            path = os.path.join(self.tmp, "template.pt")
            with open(path, "wb") as f:
                torch.save(torch.zeros(sizes, dtype=dtype), Holes(f))
                f.truncate()
            with zipfile.ZipFile(path) as z:
                rec = [i for i in z.infolist() if i.filename.endswith("/data/0")]
                assert len(rec) == 1, [i.filename for i in z.infolist()]
                rec = rec[0]
            with open(path, "rb") as f:
                f.seek(rec.header_offset + 26)
                n, m = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
                start = rec.header_offset + 30 + n + m
                f.seek(0)
                head = f.read(start)
                f.seek(start + rec.file_size)
                tail = f.read()
            assert rec.file_size == prod(sizes) * torch.tensor([], dtype=dtype).element_size()
            self.cache[k] = (head, rec.file_size, tail)
            os.remove(path)
        return self.cache[k]


def item_bytes(run, fqn):
    """The bytes of the template run's item `fqn`."""
    it = os.path.join(run, f"iter_{ITERATION:07d}")
    md = pickle.load(open(os.path.join(it, ".metadata"), "rb"))
    for mi, si in md.storage_data.items():
        if mi.fqn == fqn:
            with open(os.path.join(it, si.relative_path), "rb") as f:
                f.seek(si.offset)
                return f.read(si.length)
    raise KeyError(fqn)


def template_metadata(run):
    return pickle.load(open(os.path.join(run, f"iter_{ITERATION:07d}", ".metadata"), "rb"))


def config_of_template(run):
    """The template run's model and layout, from its saved args."""
    a = torch.load(io.BytesIO(item_bytes(run, "common_state/shard_0_1")), weights_only=False)[0]["args"]
    c = {"layers": a.num_layers, "hidden": a.hidden_size, "heads": a.num_attention_heads,
         "query_groups": a.num_query_groups, "head_dim": a.kv_channels, "ffn": a.ffn_hidden_size,
         "experts": a.num_experts, "topk": a.moe_router_topk, "moe_ffn": a.moe_ffn_hidden_size,
         "shared_ffn": a.moe_shared_expert_intermediate_size, "vocab": a.padded_vocab_size,
         "layer_freq": list(a.moe_layer_freq)}
    lay = {"pp": a.pipeline_model_parallel_size, "dp": a.data_parallel_size, "ep": a.expert_model_parallel_size}
    return c, lay


def common_state(run, c, lay):
    """The template's saved dict with the model's and the layout's sizes in `args`."""
    saved = torch.load(io.BytesIO(item_bytes(run, "common_state/shard_0_1")), weights_only=False)
    a = saved[0]["args"]
    world = lay["pp"] * lay["dp"]
    for k, v in {
        "num_layers": c["layers"], "hidden_size": c["hidden"], "ffn_hidden_size": c["ffn"],
        "num_attention_heads": c["heads"], "num_query_groups": c["query_groups"], "kv_channels": c["head_dim"],
        "group_query_attention": True, "num_experts": c["experts"], "moe_router_topk": c["topk"],
        "moe_ffn_hidden_size": c["moe_ffn"], "moe_shared_expert_intermediate_size": c["shared_ffn"],
        "moe_layer_freq": c["layer_freq"], "vocab_size": c["vocab"], "padded_vocab_size": c["vocab"],
        "seq_length": c["seq_len"], "max_position_embeddings": c["seq_len"], "rotary_base": 10000,
        "moe_router_pre_softmax": not c["norm_topk"], "world_size": world, "data_parallel_size": lay["dp"],
        "pipeline_model_parallel_size": lay["pp"], "expert_model_parallel_size": lay["ep"],
        "decoder_first_pipeline_num_layers": lay["first_stage_layers"],
        "global_batch_size": lay["dp"] * a.micro_batch_size,
    }.items():
        setattr(a, k, v)
    buf = io.BytesIO()
    torch.save(saved, buf)
    return buf.getvalue()


# ------------------------------------------------------------------------- the folder


def write(out, run, c, lay, expert_extra=True):
    """Writes the run folder OUT (latest_checkpointed_iteration.txt, iter_0000002/). Returns a
    summary dict."""
    tensors, extra = model_keys(c, expert_extra)
    ranks = place(c, lay, tensors, extra)
    md = template_metadata(run)
    props = next(v.properties for v in md.state_dict_metadata.values() if isinstance(v, TensorStorageMetadata))
    blobs = {"common_state/shard_0_1": common_state(run, c, lay)}
    ext = item_bytes(run, "decoder.layers.0.self_attention.linear_proj._extra_state/shard_0_1")
    rng = item_bytes(run, "rng_state/shard_0.0_1.1")
    shutil.rmtree(out, ignore_errors=True)
    it = os.path.join(out, f"iter_{ITERATION:07d}")
    os.makedirs(it)
    templates = Templates(out)
    sd_meta, storage, plans = {}, {}, []
    for key, shape, chunks, _ in tensors:
        sd_meta[key] = TensorStorageMetadata(properties=props, size=torch.Size(shape),
                                             chunks=[ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s))
                                                     for o, s in chunks])
    for key, _ in extra:
        sd_meta[key] = BytesStorageMetadata()
    sd_meta["common_state/shard_0_1"] = BytesStorageMetadata()
    for s in range(lay["pp"]):
        sd_meta[f"rng_state/shard_{s}.0_{lay['pp']}.1"] = BytesStorageMetadata()
    total_file_bytes = 0
    for r in sorted(ranks):
        name = f"__{r}_0.distcp"
        items = []
        with open(os.path.join(it, name), "wb") as f:
            for item in ranks[r]:
                at = f.tell()
                if item[0] == "t":
                    _, key, off, size = item
                    head, n, tail = templates.get(size)
                    f.write(head)
                    f.seek(n, os.SEEK_CUR)
                    f.write(tail)
                    index = MetadataIndex(fqn=key, offset=torch.Size(off))
                    items.append(WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=torch.Size(off), sizes=torch.Size(size)),
                        properties=props, size=sd_meta[key].size)))
                else:
                    key = item[1]
                    f.write(blobs.get(key) or (rng if key.startswith("rng_state/") else ext))
                    index = MetadataIndex(fqn=key)
                    items.append(WriteItem(index=index, type=WriteItemType.BYTE_IO))
                storage[index] = _StorageInfo(relative_path=name, offset=at, length=f.tell() - at)
            f.truncate()
            total_file_bytes += f.tell()
        plans.append(SavePlan(items=items, storage_data=None, planner_data={}, usable=True))
    md.state_dict_metadata = sd_meta
    md.storage_data = storage
    md.planner_data = None
    md.all_local_plans = plans
    md.storage_meta.checkpoint_id = f"./iter_{ITERATION:07d}"
    md.storage_meta.save_id = str(uuid.uuid4())
    with open(os.path.join(it, ".metadata"), "wb") as f:
        pickle.dump(md, f)
    shutil.copy(os.path.join(run, f"iter_{ITERATION:07d}", "metadata.json"), it)
    with open(os.path.join(out, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(ITERATION))
    params = sum(prod(shape) for _, shape, _, _ in tensors)
    chunks = sum(len(ch) for _, _, ch, _ in tensors)
    disk = sum(os.stat(os.path.join(it, n)).st_blocks * 512 for n in os.listdir(it))
    return {"tensors": len(tensors), "chunks": chunks, "bytes_items": len(sd_meta) - len(tensors),
            "parameters": params, "tensor_bytes": params * 2, "files": len(ranks), "file_bytes": total_file_bytes,
            "disk_bytes": disk, "metadata_bytes": os.path.getsize(os.path.join(it, ".metadata"))}


def dsv3_config():
    c = dict(DSV3)
    c["layer_freq"] = [0] * c["dense_layers"] + [1] * (c["layers"] - c["dense_layers"])
    return c


# ------------------------------------------------------------------------- validation


def validate(run):
    """The rule against megatron's own save of the template run: keys, dtypes, global shapes,
    chunk boxes; and the zip records of a zero item against megatron's item of the same shape."""
    c, lay = config_of_template(run)
    tensors, extra = model_keys(c)
    md = template_metadata(run)
    real_t = {k: v for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    real_b = {k for k, v in md.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)}
    mine_b = {k for k, _ in extra} | {"common_state/shard_0_1"} | \
        {f"rng_state/shard_{s}.0_{lay['pp']}.1" for s in range(lay["pp"])}
    ok = True
    if set(real_t) != {k for k, *_ in tensors}:
        print(f"FAIL: tensor keys: only megatron's {sorted(set(real_t) - {k for k, *_ in tensors})[:5]}, "
              f"only the rule's {sorted({k for k, *_ in tensors} - set(real_t))[:5]}")
        ok = False
    if real_b != mine_b:
        print(f"FAIL: bytes keys: only megatron's {sorted(real_b - mine_b)[:5]}, only the rule's {sorted(mine_b - real_b)[:5]}")
        ok = False
    for key, shape, chunks, _ in tensors:
        v = real_t.get(key)
        if v is None:
            continue
        boxes = sorted((tuple(ch.offsets), tuple(ch.sizes)) for ch in v.chunks)
        if v.properties.dtype != torch.bfloat16 or tuple(v.size) != shape or boxes != sorted(chunks):
            print(f"FAIL: {key}: megatron {v.properties.dtype} {tuple(v.size)} {boxes[:4]}, rule {shape} {sorted(chunks)[:4]}")
            ok = False
    # An item of each distinct chunk shape: megatron's zip records against the zero template's.
    it = os.path.join(run, f"iter_{ITERATION:07d}")
    import tempfile

    seen = {}
    with tempfile.TemporaryDirectory() as tmp:
        t = Templates(tmp)
        for mi, si in md.storage_data.items():
            v = md.state_dict_metadata[mi.fqn]
            if not isinstance(v, TensorStorageMetadata):
                continue
            size = next(tuple(ch.sizes) for ch in v.chunks if tuple(ch.offsets) == tuple(mi.offset))
            if size in seen:
                continue
            with open(os.path.join(it, si.relative_path), "rb") as f:
                f.seek(si.offset)
                real = f.read(si.length)
            head, n, tail = t.get(size)
            mine = head + bytes(n) + tail
            zr, zm = zipfile.ZipFile(io.BytesIO(real)), zipfile.ZipFile(io.BytesIO(mine))
            rec = lambda z: [(i.filename, i.header_offset, i.file_size, i.compress_type) for i in z.infolist()]
            same = len(real) == len(mine) and rec(zr) == rec(zm) and \
                zr.read("archive/data.pkl") == zm.read("archive/data.pkl")
            seen[size] = same
            if not same:
                print(f"FAIL: item of {mi.fqn} {size}: megatron {rec(zr)}, template {rec(zm)}")
                ok = False
    print(f"{'PASS' if ok else 'FAIL'}: the rule gives megatron's {len(real_t)} tensor keys (shapes, dtypes, "
          f"{sum(len(v.chunks) for v in real_t.values())} chunk boxes) and {len(real_b)} bytes keys of {run}; "
          f"zero items of its {len(seen)} chunk shapes have megatron's zip records and data.pkl", flush=True)
    return ok


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore")
    if len(sys.argv) == 3 and sys.argv[1] == "--validate":
        sys.exit(0 if validate(sys.argv[2]) else 1)
    elif len(sys.argv) in (3, 4) and sys.argv[3:] in ([], ["--no-expert-extra-state"]):
        print(json.dumps(write(os.path.abspath(sys.argv[1]), sys.argv[2], dsv3_config(), LAYOUT,
                               expert_extra=len(sys.argv) == 3), indent=1))
    else:
        raise SystemExit(__doc__)
