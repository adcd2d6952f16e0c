//! Writing `torch.save` files that `torch.load(weights_only=True)` accepts.
//!
//! The layout follows torch 2.13's writer: records `data.pkl`, `.format_version` (`1`),
//! `.storage_alignment` (`64`), `byteorder` (`little`), `data/0` … `data/N-1` (storages numbered
//! in order of first use), `version` (`3\n`); each stored, 64-byte aligned, followed by a data
//! descriptor, then a central directory and the zip64 end records (see [`super::zip`]). The
//! optional `.data/serialization_id` is left out; torch only logs it.
//!
//! The pickle uses protocol-2 opcodes only (torch's weights-only loader knows no others) and only
//! allow-listed globals: an `OrderedDict` of name → `_rebuild_tensor_v2(persistent storage,
//! offset, size, stride, False, OrderedDict())`, or `_rebuild_tensor_v3(…, dtype)` over an
//! `UntypedStorage` for the dtypes without a legacy storage class (float8, uint16/32/64).
//! Non-tensor values are written as plain pickle values. Several tensors may name one storage.
//!
//! Storage bytes are not known when the plan is made (they are copied or converted later), so
//! the file is finished in two steps: [`TorchLayout::fixed`] holds every byte that can be
//! written up front, and [`TorchLayout::finish`] computes the storages' CRC32s from the written
//! file and writes their descriptors and the central directory.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use super::flatten::Leaf;
use super::pickle::{storage_class, torch_dtype_name};
use super::zip::{self, PlacedRecord};
use super::{TORCH_INDEX_NAME, TORCH_SINGLE_NAME};
use crate::error::{Error, IoContext, Result};
use crate::formats::hf_index;
use crate::plan::{cut, Dest, Meta, Out, Placed};
use crate::read::dtype::Dtype;
use crate::write::{Plan, TargetFile};

/// A tensor to write: contiguous, at `offset` elements into storage `storage`.
#[derive(Clone, Debug)]
pub(crate) struct WTensor {
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    pub storage: usize,
    pub offset: u64,
}

/// What an entry of the written dict holds.
#[derive(Clone, Debug)]
pub(crate) enum WValue {
    Tensor(WTensor),
    Leaf(Leaf),
    Node(WNode),
}

/// A nested value for files that are not flat state dicts (a DeepSpeed universal
/// `optimizer_state.pt`): tensors anywhere, tuples, non-string keys, and instances of a named
/// class. Only for files read with `weights_only=False`: an instance's class is not allow-listed
/// by torch's safe loader.
#[derive(Clone, Debug)]
pub(crate) enum WNode {
    Leaf(Leaf),
    Tensor(WTensor),
    Tuple(Vec<WNode>),
    List(Vec<WNode>),
    /// A plain `dict` with keys of any kind, in order.
    Dict(Vec<(WNode, WNode)>),
    /// `module.name`: with a state, `NEWOBJ(cls, args)` then `BUILD(state)` (how a plain object
    /// pickles); without, `REDUCE(cls, args)` (an `int` enum member).
    Instance {
        module: String,
        name: String,
        args: Vec<WNode>,
        state: Option<Box<WNode>>,
    },
}

/// A storage to write: its element dtype and byte length.
#[derive(Clone, Copy, Debug)]
pub(crate) struct WStorage {
    pub dtype: Dtype,
    pub byte_len: u64,
}

/// Where everything of a torch file goes.
#[derive(Clone, Debug)]
pub(crate) struct TorchLayout {
    /// Bytes known at plan time: local headers, small records and their descriptors.
    pub fixed: Vec<(u64, Vec<u8>)>,
    /// Absolute offset of each storage's bytes, by storage index.
    pub storage_offsets: Vec<u64>,
    pub file_len: u64,
    records: Vec<PlacedRecord>,
    /// CRC32 of each record when known at plan time (everything but storages).
    crcs: Vec<Option<u32>>,
}

/// The archive folder torch would use for `path`: the file name without its extension, or
/// `archive` when that is not plain ASCII.
pub(crate) fn archive_name(path: &Path) -> String {
    let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or_default();
    if stem.is_empty() || !stem.is_ascii() || stem.contains('/') {
        "archive".into()
    } else {
        stem.to_string()
    }
}

/// Lays out a torch file holding `entries` over `storages`.
pub(crate) fn layout(
    prefix: &str,
    entries: &[(String, WValue)],
    storages: &[WStorage],
    out: &Path,
) -> Result<TorchLayout> {
    layout_pickle(prefix, encode(entries, storages), storages, out)
}

/// Lays out a torch file whose object is the single tensor `t` (not a dict): what
/// `torch.save(tensor)` writes, and what a DCP tensor item is.
pub(crate) fn layout_tensor(prefix: &str, t: &WTensor, storage: WStorage, out: &Path) -> Result<TorchLayout> {
    let storages = [storage];
    let mut pkl = vec![0x80, 2];
    tensor(&mut pkl, t, &storages);
    pkl.push(b'.');
    layout_pickle(prefix, pkl, &storages, out)
}

/// Lays out a torch file whose object is the plain value `v`: what `torch.save(value)` writes,
/// and what a DCP non-tensor item is.
pub(crate) fn layout_value(prefix: &str, v: &Leaf, out: &Path) -> Result<TorchLayout> {
    let mut pkl = vec![0x80, 2];
    leaf(&mut pkl, v);
    pkl.push(b'.');
    layout_pickle(prefix, pkl, &[], out)
}

/// Lays out a torch file whose object is the nested value `n` (records, tuples; no tensors):
/// what `torch.save(value)` writes for a value beyond a plain [`Leaf`] (a Megatron-LM run's
/// `common_state`, holding its `argparse.Namespace`).
pub(crate) fn layout_node(prefix: &str, n: &WNode, out: &Path) -> Result<TorchLayout> {
    let mut pkl = vec![0x80, 2];
    node(&mut pkl, n, &[]);
    pkl.push(b'.');
    layout_pickle(prefix, pkl, &[], out)
}

fn layout_pickle(prefix: &str, pkl: Vec<u8>, storages: &[WStorage], out: &Path) -> Result<TorchLayout> {
    for d in storages.iter().map(|s| s.dtype) {
        if torch_dtype_name(d).is_none() {
            return Err(Error::BadTorchFile { path: out.to_path_buf(), reason: format!("cannot write dtype `{d}`") });
        }
    }
    let mut recs: Vec<(String, u64)> = vec![
        (format!("{prefix}/data.pkl"), pkl.len() as u64),
        (format!("{prefix}/.format_version"), 1),
        (format!("{prefix}/.storage_alignment"), 2),
        (format!("{prefix}/byteorder"), 6),
    ];
    let first_storage = recs.len();
    for (i, s) in storages.iter().enumerate() {
        recs.push((format!("{prefix}/data/{i}"), s.byte_len));
    }
    recs.push((format!("{prefix}/version"), 2));
    let (records, end) = zip::place(&recs);
    let small: Vec<Option<&[u8]>> = (0..records.len())
        .map(|i| match i {
            0 => Some(&pkl[..]),
            1 => Some(&b"1"[..]),
            2 => Some(&b"64"[..]),
            3 => Some(&b"little"[..]),
            _ if i == records.len() - 1 => Some(&b"3\n"[..]),
            _ => None,
        })
        .collect();
    let mut fixed = Vec::new();
    let mut crcs = Vec::with_capacity(records.len());
    for (r, payload) in records.iter().zip(&small) {
        let mut bytes = r.local_header.clone();
        match payload {
            Some(p) => {
                let crc = crc32fast::hash(p);
                bytes.extend_from_slice(p);
                bytes.extend_from_slice(&zip::descriptor(r, crc));
                crcs.push(Some(crc));
            }
            None => crcs.push(None),
        }
        fixed.push((r.header_offset, bytes));
    }
    let storage_offsets = records.iter().skip(first_storage).take(storages.len()).map(|r| r.data_offset).collect();
    // The central directory adds at most 46 + name + 28 bytes per record and 98 at the end.
    let cd_len = zip::central_directory(&records.iter().map(|r| (r.clone(), 0)).collect::<Vec<_>>(), end).len() as u64;
    Ok(TorchLayout { fixed, storage_offsets, file_len: end + cd_len, records, crcs })
}

/// The torch archives inside one target file, each at its base offset (one for a `torch.save`
/// file, one per item for a DCP rank file): their fixed bytes and CRCs are written once the
/// storages are in place.
#[derive(Debug)]
pub(crate) struct TorchSeal(pub Vec<(u64, TorchLayout)>);

impl crate::write::Seal for TorchSeal {
    fn seal(&self, file: &File, path: &Path) -> Result<()> {
        for (base, layout) in &self.0 {
            layout.write_fixed_at(file, path, *base)?;
            layout.finish_at(file, path, *base)?;
        }
        Ok(())
    }
}

impl TorchLayout {
    /// Writes the plan-time bytes of an archive that starts at byte `base` of `file` (0 for a
    /// torch file; a DCP item's offset, since zip offsets stay relative to the archive's start).
    pub(crate) fn write_fixed_at(&self, file: &File, path: &Path, base: u64) -> Result<()> {
        for (at, bytes) in &self.fixed {
            file.write_all_at(bytes, base + at).at(path)?;
        }
        Ok(())
    }

    /// Once storages are written: computes their CRC32 from the file, writes their descriptors
    /// and the central directory, for the archive at byte `base` of `file`.
    pub(crate) fn finish_at(&self, file: &File, path: &Path, base: u64) -> Result<()> {
        self.finish_known(file, path, base, &[])
    }

    /// [`TorchLayout::finish_at`] for an archive whose storages' CRC32s the caller computed
    /// from the bytes it wrote (`crcs`, by storage index), so nothing is read back.
    pub(crate) fn finish_known(&self, file: &File, path: &Path, base: u64, crcs: &[u32]) -> Result<()> {
        let mut done = Vec::with_capacity(self.records.len());
        let mut buf = Vec::new();
        let mut storage = 0usize;
        for (r, crc) in self.records.iter().zip(&self.crcs) {
            let crc = match crc {
                Some(c) => *c,
                None if storage < crcs.len() => {
                    let c = crcs[storage];
                    storage += 1;
                    file.write_all_at(&zip::descriptor(r, c), base + r.descriptor_offset).at(path)?;
                    c
                }
                None => {
                    storage += 1;
                    if buf.is_empty() {
                        buf = vec![0u8; 8 << 20];
                    }
                    let mut h = crc32fast::Hasher::new();
                    let mut at = 0u64;
                    while at < r.size {
                        let n = usize::try_from((r.size - at).min(buf.len() as u64)).unwrap_or(buf.len());
                        let window = buf.get_mut(..n).unwrap_or_default();
                        file.read_exact_at(window, base + r.data_offset + at).at(path)?;
                        h.update(window);
                        at += n as u64;
                    }
                    let c = h.finalize();
                    file.write_all_at(&zip::descriptor(r, c), base + r.descriptor_offset).at(path)?;
                    c
                }
            };
            done.push((r.clone(), crc));
        }
        let at = self.records.last().map_or(0, |r| r.descriptor_offset + if r.zip64_descriptor { 24 } else { 16 });
        file.write_all_at(&zip::central_directory(&done, at), base + at).at(path)?;
        Ok(())
    }
}

/// The pickle of an `OrderedDict` of the entries.
pub(crate) fn encode(entries: &[(String, WValue)], storages: &[WStorage]) -> Vec<u8> {
    let mut p = Vec::with_capacity(64 + entries.len() * 160);
    p.extend_from_slice(&[0x80, 2]);
    ordered_dict(&mut p);
    for (n, batch) in entries.chunks(1000).enumerate() {
        let _ = n;
        p.push(b'(');
        for (name, v) in batch {
            string(&mut p, name);
            match v {
                WValue::Tensor(t) => tensor(&mut p, t, storages),
                WValue::Leaf(l) => leaf(&mut p, l),
                WValue::Node(n) => node(&mut p, n, storages),
            }
        }
        p.push(b'u');
    }
    p.push(b'.');
    p
}

fn global(p: &mut Vec<u8>, module: &str, name: &str) {
    p.push(b'c');
    p.extend_from_slice(module.as_bytes());
    p.push(b'\n');
    p.extend_from_slice(name.as_bytes());
    p.push(b'\n');
}

fn ordered_dict(p: &mut Vec<u8>) {
    global(p, "collections", "OrderedDict");
    p.extend_from_slice(b")R");
}

fn string(p: &mut Vec<u8>, s: &str) {
    p.push(b'X');
    p.extend_from_slice(&(s.len() as u32).to_le_bytes());
    p.extend_from_slice(s.as_bytes());
}

fn int(p: &mut Vec<u8>, v: i64) {
    if (0..=0xff).contains(&v) {
        p.extend_from_slice(&[b'K', v as u8]);
    } else if (0..=0xffff).contains(&v) {
        p.push(b'M');
        p.extend_from_slice(&(v as u16).to_le_bytes());
    } else if let Ok(v) = i32::try_from(v) {
        p.push(b'J');
        p.extend_from_slice(&v.to_le_bytes());
    } else {
        // LONG1: the shortest little-endian two's complement.
        let bytes = v.to_le_bytes();
        let mut n = 8;
        while n > 1 {
            let (last, prev) = (bytes[n - 1], bytes[n - 2]);
            if (last == 0 && prev & 0x80 == 0) || (last == 0xff && prev & 0x80 != 0) {
                n -= 1;
            } else {
                break;
            }
        }
        p.extend_from_slice(&[0x8a, n as u8]);
        p.extend_from_slice(&bytes[..n]);
    }
}

fn uint(p: &mut Vec<u8>, v: u64) {
    match i64::try_from(v) {
        Ok(v) => int(p, v),
        Err(_) => {
            p.extend_from_slice(&[0x8a, 9]);
            p.extend_from_slice(&v.to_le_bytes());
            p.push(0);
        }
    }
}

fn tuple_of(p: &mut Vec<u8>, items: &[u64]) {
    match items.len() {
        0 => p.push(b')'),
        1..=3 => {
            for &i in items {
                uint(p, i);
            }
            p.push(0x84 + items.len() as u8);
        }
        _ => {
            p.push(b'(');
            for &i in items {
                uint(p, i);
            }
            p.push(b't');
        }
    }
}

fn tensor(p: &mut Vec<u8>, t: &WTensor, storages: &[WStorage]) {
    let s = storages.get(t.storage).copied().unwrap_or(WStorage { dtype: t.dtype, byte_len: 0 });
    let class = storage_class(t.dtype);
    global(p, "torch._utils", if class.is_some() { "_rebuild_tensor_v2" } else { "_rebuild_tensor_v3" });
    p.push(b'(');
    // The persistent id: ("storage", class, key, "cpu", numel).
    p.push(b'(');
    string(p, "storage");
    let elem = s.dtype.bits() / 8;
    match storage_class(s.dtype) {
        Some(c) => {
            global(p, "torch", c);
            string(p, &t.storage.to_string());
            string(p, "cpu");
            uint(p, s.byte_len / elem.max(1));
        }
        None => {
            global(p, "torch.storage", "UntypedStorage");
            string(p, &t.storage.to_string());
            string(p, "cpu");
            uint(p, s.byte_len);
        }
    }
    p.extend_from_slice(b"tQ");
    uint(p, t.offset);
    tuple_of(p, &t.shape);
    let mut strides = vec![0u64; t.shape.len()];
    let mut acc = 1u64;
    for (st, &n) in strides.iter_mut().zip(&t.shape).rev() {
        *st = acc;
        acc = acc.saturating_mul(n);
    }
    tuple_of(p, &strides);
    p.push(0x89);
    ordered_dict(p);
    if class.is_none() {
        global(p, "torch", torch_dtype_name(t.dtype).unwrap_or("uint8"));
    }
    p.extend_from_slice(b"tR");
}

fn leaf(p: &mut Vec<u8>, l: &Leaf) {
    match l {
        Leaf::None => p.push(b'N'),
        Leaf::Bool(b) => p.push(if *b { 0x88 } else { 0x89 }),
        Leaf::Int(i) => int(p, *i),
        Leaf::Float(f) => {
            p.push(b'G');
            p.extend_from_slice(&f.to_be_bytes());
        }
        Leaf::Str(s) => string(p, s),
        Leaf::Bytes(b) => {
            global(p, "_codecs", "encode");
            let text: String = b.iter().map(|&c| char::from(c)).collect();
            string(p, &text);
            string(p, "latin1");
            p.extend_from_slice(&[0x86, b'R']);
        }
        Leaf::List(items) => {
            p.push(b']');
            if !items.is_empty() {
                p.push(b'(');
                for i in items {
                    leaf(p, i);
                }
                p.push(b'e');
            }
        }
        Leaf::Dict(items) => {
            p.push(b'}');
            if !items.is_empty() {
                p.push(b'(');
                for (k, v) in items {
                    string(p, k);
                    leaf(p, v);
                }
                p.push(b'u');
            }
        }
    }
}

fn node(p: &mut Vec<u8>, n: &WNode, storages: &[WStorage]) {
    match n {
        WNode::Leaf(l) => leaf(p, l),
        WNode::Tensor(t) => tensor(p, t, storages),
        WNode::Tuple(items) => {
            p.push(b'(');
            for i in items {
                node(p, i, storages);
            }
            p.push(b't');
        }
        WNode::List(items) => {
            p.push(b']');
            if !items.is_empty() {
                p.push(b'(');
                for i in items {
                    node(p, i, storages);
                }
                p.push(b'e');
            }
        }
        WNode::Dict(items) => {
            p.push(b'}');
            if !items.is_empty() {
                p.push(b'(');
                for (k, v) in items {
                    node(p, k, storages);
                    node(p, v, storages);
                }
                p.push(b'u');
            }
        }
        WNode::Instance { module, name, args, state } => {
            global(p, module, name);
            node(p, &WNode::Tuple(args.clone()), storages);
            match state {
                Some(st) => {
                    p.push(0x81);
                    node(p, st, storages);
                    p.push(b'b');
                }
                None => p.push(b'R'),
            }
        }
    }
}

/// Plans `outs` as `torch.save` files at `dest`, with the non-tensor `values` in the first
/// file's pickle. A tensor tied to another in the same file shares its storage.
pub(crate) fn plan(
    outs: &[Out<'_>],
    values: &[(String, Leaf)],
    meta: &Meta,
    dest: &Dest,
    plan: &mut Plan,
) -> Result<Placed> {
    let (files, total) = cut(outs, dest, TORCH_SINGLE_NAME, "pytorch_model", ".bin");
    for (si, (path, members)) in files.iter().enumerate() {
        let mut storages: Vec<WStorage> = Vec::new();
        let mut storage_of: HashMap<usize, usize> = HashMap::new();
        let mut entries = Vec::with_capacity(members.len());
        for &i in members {
            let o = &outs[i];
            let owner = o.tied_to.filter(|k| members.contains(k)).unwrap_or(i);
            let sidx = *storage_of.entry(owner).or_insert_with(|| {
                storages.push(WStorage { dtype: o.dtype, byte_len: o.byte_len() });
                storages.len() - 1
            });
            let t = WTensor { dtype: o.dtype, shape: o.tensor.shape.clone(), storage: sidx, offset: 0 };
            entries.push((o.tensor.name.clone(), WValue::Tensor(t)));
        }
        if si == 0 {
            entries.extend(values.iter().map(|(k, v)| (k.clone(), WValue::Leaf(v.clone()))));
        }
        let layout = layout(&archive_name(path), &entries, &storages, path)?;
        let mut target = TargetFile::new(path.clone(), Vec::new(), layout.file_len);
        for &i in members {
            let o = &outs[i];
            if o.tied_to.is_some_and(|k| members.contains(&k)) {
                continue;
            }
            let off = storage_of.get(&i).and_then(|&s| layout.storage_offsets.get(s)).copied().unwrap_or(0);
            target.place(o.tensor, o.dtype, off, o.compute.clone());
        }
        target.seal = Some(Box::new(TorchSeal(vec![(0, layout)])));
        plan.targets.push(target);
    }
    hf_index::finish_sharded(plan, &files, outs, dest, meta, total, ("pytorch_model", ".bin", TORCH_INDEX_NAME))
}
