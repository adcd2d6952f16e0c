//! The zip container of `torch.save` files: a reader that trusts nothing, and the layout torch's
//! own writer produces.
//!
//! A zip file is read from its end. The end-of-central-directory record (`PK\x05\x06`, within
//! the last 64 KiB + 22 bytes) gives the entry count and the offset of the central directory; when
//! any of those fields is saturated (`0xFFFF`/`0xFFFFFFFF`) a zip64 locator (`PK\x06\x07`, 20 bytes
//! before it) points at a zip64 end record with 64-bit values. Each central entry (`PK\x01\x02`)
//! gives a name, the compression method, the sizes, a CRC and the offset of the entry's local
//! header; saturated fields are found in its zip64 extra field (id `0x0001`), in the order size,
//! compressed size, offset. The payload starts after the *local* header (`PK\x03\x04`: 30 bytes,
//! then the name, then the local extra fields), whose extra length differs from the central one:
//! torch pads every local header with an extra field (id `0x4246`, "FB", body of `Z` bytes) so
//! that each payload starts at a multiple of 64 from the start of the file.
//!
//! torch writes every entry *stored* (method 0) with bit 3 set: CRC and sizes are 0 in the local
//! header and follow the payload in a data descriptor (`PK\x07\x08`, CRC, sizes; the sizes are
//! 8 bytes when the entry is ≥ 4 GiB or starts past 4 GiB). The central directory always carries
//! the true values, so we take sizes from there. A zip64 end record and locator are written
//! even for tiny archives.
//!
//! Validation before handing out a byte: every payload lies inside the file, no two payloads
//! overlap (the "overlapping entries" zip bomb), the central directory is bounded, and a deflated
//! entry is only ever inflated into a buffer capped by both its declared size and a limit, so a
//! small file cannot expand without bound.

use std::path::{Path, PathBuf};

use crate::error::{Error, IoContext, Result, ZipProblem};

const LOCAL_SIG: u32 = 0x0403_4b50;
const CENTRAL_SIG: u32 = 0x0201_4b50;
const EOCD_SIG: u32 = 0x0605_4b50;
const EOCD64_SIG: u32 = 0x0606_4b50;
const LOCATOR_SIG: u32 = 0x0706_4b50;
const DESCRIPTOR_SIG: u32 = 0x0807_4b50;

/// The largest central directory we read (a million entries of typical size fit easily).
const MAX_CENTRAL_DIR: u64 = 256 << 20;
const MAX_ENTRIES: u64 = 4 << 20;

/// Compression of an entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Method {
    Stored,
    Deflated,
}

/// One archive entry, its payload located and bounds-checked.
#[derive(Clone, Debug)]
pub(crate) struct Entry {
    pub name: String,
    pub method: Method,
    /// Bytes of the payload in the file.
    pub compressed: u64,
    /// Bytes once inflated (equal to `compressed` for stored entries).
    pub size: u64,
    /// Absolute offset of the payload.
    pub data_offset: u64,
    /// CRC32 of the plain bytes, from the central directory.
    pub crc: u32,
}

/// An opened archive: its entries in central-directory order.
#[derive(Debug)]
pub(crate) struct Archive {
    pub path: PathBuf,
    pub entries: Vec<Entry>,
}

/// Positional reads: a file, or bytes in memory (for tests and fuzzing).
pub(crate) use crate::read::io::ReadAt;

fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes(b.get(at..at + 2)?.try_into().ok()?))
}
fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
}
fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?))
}

impl Archive {
    /// Reads the central directory of `file` (of length `len`) and locates every payload.
    pub(crate) fn open(file: &(impl ReadAt + ?Sized), len: u64, path: &Path) -> Result<Archive> {
        let src = Source { file, len, path };
        let (count, cd_size, cd_off) = src.directory_bounds()?;
        if count > MAX_ENTRIES || cd_size > MAX_CENTRAL_DIR {
            return Err(src.bad(ZipProblem::DirectoryTooLarge { count, size: cd_size }));
        }
        let cd = src.read(cd_off, cd_size)?;
        let mut entries = Vec::with_capacity(usize::try_from(count).unwrap_or(0));
        let mut at = 0usize;
        for _ in 0..count {
            let (entry, next) = central_entry(&cd, at).ok_or_else(|| src.bad(ZipProblem::BadCentralEntry { at }))?;
            at = next;
            entries.push(entry);
        }
        let mut located = Vec::with_capacity(entries.len());
        for c in entries {
            located.push(src.locate(c)?);
        }
        src.check_disjoint(&located)?;
        Ok(Archive { path: path.to_path_buf(), entries: located })
    }

    pub(crate) fn find(&self, name: &str) -> Option<&Entry> {
        self.entries.iter().find(|e| e.name == name)
    }

    /// Reads a whole entry into memory, inflating it if needed, refusing anything whose declared
    /// or actual plain size exceeds `limit`.
    pub(crate) fn read_entry(&self, file: &(impl ReadAt + ?Sized), entry: &Entry, limit: u64) -> Result<Vec<u8>> {
        let too_big =
            |size: u64| Error::RecordTooLarge { path: self.path.clone(), record: entry.name.clone(), size, limit };
        if entry.size > limit {
            return Err(too_big(entry.size));
        }
        // Bounded by `limit` (stored: size == compressed) or by the file length (deflated input).
        let mut raw = vec![0u8; usize::try_from(entry.compressed).map_err(|_| too_big(entry.compressed))?];
        file.read_exact_at(&mut raw, entry.data_offset).at(&self.path)?;
        let out = match entry.method {
            Method::Stored => raw,
            Method::Deflated => {
                // Inflate at most one byte past the declared size: more means the header lied.
                let cap = usize::try_from(entry.size.saturating_add(1)).unwrap_or(usize::MAX);
                let out = miniz_oxide::inflate::decompress_to_vec_with_limit(&raw, cap).map_err(|e| {
                    if e.status == miniz_oxide::inflate::TINFLStatus::HasMoreOutput {
                        Error::InflateOverrun {
                            path: self.path.clone(),
                            record: entry.name.clone(),
                            declared: entry.size,
                        }
                    } else {
                        Error::BadZip {
                            path: self.path.clone(),
                            problem: ZipProblem::CorruptDeflate {
                                entry: entry.name.clone(),
                                status: format!("{:?}", e.status),
                            },
                        }
                    }
                })?;
                if out.len() as u64 != entry.size {
                    return Err(Error::InflateOverrun {
                        path: self.path.clone(),
                        record: entry.name.clone(),
                        declared: entry.size,
                    });
                }
                out
            }
        };
        let actual = crc32fast::hash(&out);
        if actual != entry.crc {
            return Err(Error::BadChecksum {
                path: self.path.clone(),
                tensor: None,
                rank: None,
                record: entry.name.clone(),
                item: None,
                stored: entry.crc,
                actual,
            });
        }
        Ok(out)
    }
}

/// The archive file being opened, for the phases of [`Archive::open`].
struct Source<'a, F: ReadAt + ?Sized> {
    file: &'a F,
    len: u64,
    path: &'a Path,
}

impl<F: ReadAt + ?Sized> Source<'_, F> {
    fn bad(&self, problem: ZipProblem) -> Error {
        Error::BadZip { path: self.path.to_path_buf(), problem }
    }

    /// `n` bytes at `off`, refused where they run past the end of the file.
    fn read(&self, off: u64, n: u64) -> Result<Vec<u8>> {
        let len = self.len;
        let end = off
            .checked_add(n)
            .filter(|&e| e <= len)
            .ok_or_else(|| self.bad(ZipProblem::PastFile { offset: off, len: n, file_len: len }))?;
        let mut buf = vec![0u8; usize::try_from(end - off).map_err(|_| self.bad(ZipProblem::RecordTooLarge))?];
        self.file.read_exact_at(&mut buf, off).at(self.path)?;
        Ok(buf)
    }

    /// The central directory's entry count, size and offset, from the end record (or the zip64
    /// end record its locator points at).
    fn directory_bounds(&self) -> Result<(u64, u64, u64)> {
        // The end record is 22 bytes plus a comment of at most 65535 bytes.
        let tail_len = self.len.min(22 + 65535);
        let tail_start = self.len - tail_len;
        let tail = self.read(tail_start, tail_len)?;
        let eocd_pos = (0..tail.len().saturating_sub(21))
            .rev()
            .find(|&i| u32_at(&tail, i) == Some(EOCD_SIG))
            .ok_or_else(|| self.bad(ZipProblem::NoEndRecord))?;
        let eocd = tail.get(eocd_pos..).unwrap_or_default();
        let field = |at| u16_at(eocd, at).ok_or_else(|| self.bad(ZipProblem::TruncatedEndRecord));
        let mut count = u64::from(field(10)?);
        let mut cd_size = u64::from(u32_at(eocd, 12).ok_or_else(|| self.bad(ZipProblem::TruncatedEndRecord))?);
        let mut cd_off = u64::from(u32_at(eocd, 16).ok_or_else(|| self.bad(ZipProblem::TruncatedEndRecord))?);
        let eocd_abs = tail_start + eocd_pos as u64;
        if eocd_abs >= 20 {
            let loc = self.read(eocd_abs - 20, 20)?;
            if u32_at(&loc, 0) == Some(LOCATOR_SIG) {
                let rec_off = u64_at(&loc, 8).unwrap_or(u64::MAX);
                let rec = self.read(rec_off, 56)?;
                if u32_at(&rec, 0) != Some(EOCD64_SIG) {
                    return Err(self.bad(ZipProblem::NoZip64EndRecord { at: rec_off }));
                }
                count = u64_at(&rec, 32).unwrap_or(0);
                cd_size = u64_at(&rec, 40).unwrap_or(0);
                cd_off = u64_at(&rec, 48).unwrap_or(0);
            }
        }
        Ok((count, cd_size, cd_off))
    }

    /// Locates an entry's payload from its local header, inside the file.
    fn locate(&self, c: Central) -> Result<Entry> {
        let local = self.read(c.header_offset, 30)?;
        if u32_at(&local, 0) != Some(LOCAL_SIG) {
            return Err(self.bad(ZipProblem::NoLocalHeader { entry: c.name, at: c.header_offset }));
        }
        let name_len = u64::from(u16_at(&local, 26).unwrap_or(0));
        let extra_len = u64::from(u16_at(&local, 28).unwrap_or(0));
        let data_offset = c.header_offset + 30 + name_len + extra_len;
        let method = match c.method {
            0 => Method::Stored,
            8 => Method::Deflated,
            method => return Err(self.bad(ZipProblem::CompressionMethod { entry: c.name, method })),
        };
        if method == Method::Stored && c.compressed != c.size {
            return Err(self.bad(ZipProblem::StoredSizes { entry: c.name, compressed: c.compressed, size: c.size }));
        }
        if data_offset.checked_add(c.compressed).is_none_or(|end| end > self.len) {
            return Err(Error::RecordBeyondFile {
                path: self.path.to_path_buf(),
                record: c.name,
                offset: data_offset,
                len: c.compressed,
                file_len: self.len,
            });
        }
        Ok(Entry { name: c.name, method, compressed: c.compressed, size: c.size, data_offset, crc: c.crc })
    }

    /// No two payloads share a byte.
    fn check_disjoint(&self, located: &[Entry]) -> Result<()> {
        let mut spans: Vec<(u64, u64, &str)> = located
            .iter()
            .filter(|e| e.compressed > 0)
            .map(|e| (e.data_offset, e.compressed, e.name.as_str()))
            .collect();
        spans.sort_unstable();
        for w in spans.windows(2) {
            if let [(a_off, a_len, a), (b_off, _, b)] = w {
                if a_off + a_len > *b_off {
                    return Err(self.bad(ZipProblem::Overlap { first: a.to_string(), second: b.to_string() }));
                }
            }
        }
        Ok(())
    }
}

struct Central {
    name: String,
    method: u16,
    crc: u32,
    compressed: u64,
    size: u64,
    header_offset: u64,
}

/// Parses the central entry at `at`; returns it and the offset of the next one.
fn central_entry(cd: &[u8], at: usize) -> Option<(Central, usize)> {
    if u32_at(cd, at)? != CENTRAL_SIG {
        return None;
    }
    let method = u16_at(cd, at + 10)?;
    let crc = u32_at(cd, at + 16)?;
    let mut compressed = u64::from(u32_at(cd, at + 20)?);
    let mut size = u64::from(u32_at(cd, at + 24)?);
    let name_len = usize::from(u16_at(cd, at + 28)?);
    let extra_len = usize::from(u16_at(cd, at + 30)?);
    let comment_len = usize::from(u16_at(cd, at + 32)?);
    let mut header_offset = u64::from(u32_at(cd, at + 42)?);
    let name_start = at + 46;
    let name = std::str::from_utf8(cd.get(name_start..name_start + name_len)?).ok()?.to_string();
    let extra = cd.get(name_start + name_len..name_start + name_len + extra_len)?;
    let mut e = 0usize;
    while e + 4 <= extra.len() {
        let id = u16_at(extra, e)?;
        let n = usize::from(u16_at(extra, e + 2)?);
        let body = extra.get(e + 4..e + 4 + n)?;
        if id == 0x0001 {
            let mut f = 0usize;
            for slot in [&mut size, &mut compressed, &mut header_offset] {
                if *slot == u64::from(u32::MAX) {
                    *slot = u64_at(body, f)?;
                    f += 8;
                }
            }
        }
        e += 4 + n;
    }
    Some((
        Central { name, method, crc, compressed, size, header_offset },
        name_start + name_len + extra_len + comment_len,
    ))
}

/// What torch's writer aligns payloads to (`torch.utils.serialization.config.save.storage_alignment`).
pub(crate) const ALIGNMENT: u64 = 64;
const FOUR_GIB: u64 = 1 << 32;

/// One record of an archive being written: its name, size and where everything goes.
#[derive(Clone, Debug)]
pub(crate) struct PlacedRecord {
    pub name: String,
    pub size: u64,
    pub header_offset: u64,
    /// The local header, with its zip64 and alignment extras.
    pub local_header: Vec<u8>,
    pub data_offset: u64,
    /// Offset of the data descriptor right after the payload.
    pub descriptor_offset: u64,
    pub zip64_descriptor: bool,
}

/// Lays out records the way torch's writer (miniz with zip64 and 64-byte alignment) does:
/// local header, padding extra, payload, data descriptor, in order.
pub(crate) fn place(records: &[(String, u64)]) -> (Vec<PlacedRecord>, u64) {
    let mut out = Vec::with_capacity(records.len());
    let mut pos = 0u64;
    for (name, size) in records {
        let header_offset = pos;
        let big = *size >= FOUR_GIB;
        let far = header_offset >= FOUR_GIB;
        let mut zip64 = Vec::new();
        if big || far {
            // Same shape as miniz: uncompressed and compressed size (0, the descriptor has it),
            // then the header offset when the header lies past 4 GiB.
            zip64.extend_from_slice(&1u16.to_le_bytes());
            let n: u16 = if far { 24 } else { 16 };
            zip64.extend_from_slice(&n.to_le_bytes());
            zip64.extend_from_slice(&size.to_le_bytes());
            zip64.extend_from_slice(&0u64.to_le_bytes());
            if far {
                zip64.extend_from_slice(&header_offset.to_le_bytes());
            }
        }
        let unpadded = header_offset + 30 + name.len() as u64 + zip64.len() as u64 + 4;
        let pad = (ALIGNMENT - unpadded % ALIGNMENT) % ALIGNMENT;
        let extra_len = zip64.len() as u64 + 4 + pad;
        let mut h = Vec::with_capacity(30 + name.len() + extra_len as usize);
        h.extend_from_slice(&LOCAL_SIG.to_le_bytes());
        h.extend_from_slice(&0u16.to_le_bytes()); // version needed, as torch writes it
        h.extend_from_slice(&0x0808u16.to_le_bytes()); // data descriptor follows; UTF-8 names
        h.extend_from_slice(&0u16.to_le_bytes()); // stored
        h.extend_from_slice(&[0u8; 4]); // time, date
        h.extend_from_slice(&[0u8; 12]); // crc and sizes: in the descriptor
        h.extend_from_slice(&(name.len() as u16).to_le_bytes());
        h.extend_from_slice(&(extra_len as u16).to_le_bytes());
        h.extend_from_slice(name.as_bytes());
        h.extend_from_slice(&zip64);
        h.extend_from_slice(&0x4246u16.to_le_bytes());
        h.extend_from_slice(&(pad as u16).to_le_bytes());
        h.resize(h.len() + pad as usize, b'Z');
        let data_offset = header_offset + h.len() as u64;
        let descriptor_offset = data_offset + size;
        let zip64_descriptor = big || far;
        pos = descriptor_offset + if zip64_descriptor { 24 } else { 16 };
        out.push(PlacedRecord {
            name: name.clone(),
            size: *size,
            header_offset,
            local_header: h,
            data_offset,
            descriptor_offset,
            zip64_descriptor,
        });
    }
    (out, pos)
}

/// The data descriptor that follows a payload.
pub(crate) fn descriptor(r: &PlacedRecord, crc: u32) -> Vec<u8> {
    let mut d = Vec::with_capacity(24);
    d.extend_from_slice(&DESCRIPTOR_SIG.to_le_bytes());
    d.extend_from_slice(&crc.to_le_bytes());
    if r.zip64_descriptor {
        d.extend_from_slice(&r.size.to_le_bytes());
        d.extend_from_slice(&r.size.to_le_bytes());
    } else {
        d.extend_from_slice(&(r.size as u32).to_le_bytes());
        d.extend_from_slice(&(r.size as u32).to_le_bytes());
    }
    d
}

/// The central directory, zip64 end record, locator and end record, written at `at`.
pub(crate) fn central_directory(records: &[(PlacedRecord, u32)], at: u64) -> Vec<u8> {
    let mut cd = Vec::new();
    for (r, crc) in records {
        let mut zip64 = Vec::new();
        let size32 = if r.size >= FOUR_GIB {
            zip64.extend_from_slice(&r.size.to_le_bytes());
            zip64.extend_from_slice(&r.size.to_le_bytes());
            u32::MAX
        } else {
            r.size as u32
        };
        let off32 = if r.header_offset >= FOUR_GIB {
            zip64.extend_from_slice(&r.header_offset.to_le_bytes());
            u32::MAX
        } else {
            r.header_offset as u32
        };
        cd.extend_from_slice(&CENTRAL_SIG.to_le_bytes());
        cd.extend_from_slice(&0u16.to_le_bytes()); // made by
        cd.extend_from_slice(&0u16.to_le_bytes()); // needed
        cd.extend_from_slice(&0x0808u16.to_le_bytes());
        cd.extend_from_slice(&0u16.to_le_bytes()); // stored
        cd.extend_from_slice(&[0u8; 4]);
        cd.extend_from_slice(&crc.to_le_bytes());
        cd.extend_from_slice(&size32.to_le_bytes());
        cd.extend_from_slice(&size32.to_le_bytes());
        cd.extend_from_slice(&(r.name.len() as u16).to_le_bytes());
        let extra_len = if zip64.is_empty() { 0 } else { zip64.len() + 4 };
        cd.extend_from_slice(&(extra_len as u16).to_le_bytes());
        cd.extend_from_slice(&[0u8; 6]); // comment length, disk, internal attributes
        cd.extend_from_slice(&[0u8; 4]); // external attributes
        cd.extend_from_slice(&off32.to_le_bytes());
        cd.extend_from_slice(r.name.as_bytes());
        if !zip64.is_empty() {
            cd.extend_from_slice(&1u16.to_le_bytes());
            cd.extend_from_slice(&(zip64.len() as u16).to_le_bytes());
            cd.extend_from_slice(&zip64);
        }
    }
    let n = records.len() as u64;
    let cd_len = cd.len() as u64;
    let eocd64_at = at + cd_len;
    let mut out = cd;
    out.extend_from_slice(&EOCD64_SIG.to_le_bytes());
    out.extend_from_slice(&44u64.to_le_bytes());
    out.extend_from_slice(&0x031eu16.to_le_bytes());
    out.extend_from_slice(&45u16.to_le_bytes());
    out.extend_from_slice(&[0u8; 8]); // disk numbers
    out.extend_from_slice(&n.to_le_bytes());
    out.extend_from_slice(&n.to_le_bytes());
    out.extend_from_slice(&cd_len.to_le_bytes());
    out.extend_from_slice(&at.to_le_bytes());
    out.extend_from_slice(&LOCATOR_SIG.to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    out.extend_from_slice(&eocd64_at.to_le_bytes());
    out.extend_from_slice(&1u32.to_le_bytes());
    let sat16 = |v: u64| u16::try_from(v).unwrap_or(u16::MAX);
    let sat32 = |v: u64| u32::try_from(v).unwrap_or(u32::MAX);
    out.extend_from_slice(&EOCD_SIG.to_le_bytes());
    out.extend_from_slice(&[0u8; 4]);
    out.extend_from_slice(&sat16(n).to_le_bytes());
    out.extend_from_slice(&sat16(n).to_le_bytes());
    out.extend_from_slice(&sat32(cd_len).to_le_bytes());
    out.extend_from_slice(&sat32(at).to_le_bytes());
    out.extend_from_slice(&0u16.to_le_bytes());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payloads_are_aligned_and_zip64_kicks_in_past_4gib() {
        let (placed, end) = place(&[("x/data.pkl".into(), 563), ("x/data/0".into(), 5 << 30), ("x/data/1".into(), 3)]);
        for r in &placed {
            assert_eq!(r.data_offset % ALIGNMENT, 0, "{}", r.name);
            assert_eq!(r.header_offset + r.local_header.len() as u64, r.data_offset);
        }
        assert!(placed[1].zip64_descriptor && placed[2].zip64_descriptor);
        assert_eq!(end, placed[2].descriptor_offset + 24);
        // torch's own first record: 30 + 10 name bytes + 24 extra bytes = 64.
        assert_eq!(placed[0].data_offset, 64);
    }
}
