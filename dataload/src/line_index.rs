//! The line-offset index of a JSON-lines file, built once and kept beside it.
//!
//! # On disk (`<file>.lines.idx`, all integers little-endian)
//!
//! ```text
//! magic            8 bytes  "SKLINES\0"
//! version          u32      1
//! kind             u32      0 = plain text, 1 = zstd
//! source_size      u64      size of the data file when indexed
//! mtime_secs       u64      its modification time, seconds since the Unix epoch
//! mtime_nanos      u32      and nanoseconds
//! reserved         u32      0
//! text_len         u64      length of the (decompressed) text
//! n_frames         u64      zstd frames (0 for plain text)
//! n_lines          u64      records
//! frames           n_frames × (offset u64, length u64, text_start u64)
//! lines            n_lines × (start u64, end u64)
//! ```
//!
//! A frame is a zstd frame of the file: where it is in the compressed file and where its
//! output starts in the text. A line is a record: its byte range in the text, without the
//! newline (and without a `\r` before it). Blank lines are not records. Frames are contiguous
//! and cover the file exactly, the first starting the text; lines are in order, never empty,
//! separated, and inside the text; the file's length is exactly what the counts call for. In a
//! plain file each line must also start after a newline and end at one, which two byte reads
//! per line check against the data itself.
//!
//! An index whose header is not one (wrong magic, version or kind), or whose size or
//! modification time is not the data file's, is stale: it is rebuilt. An index whose header
//! matches the data file but whose contents fail a check is corrupt: opening the dataset fails
//! with an error naming the index, rather than trusting it because its size and time match, or
//! silently rebuilding over what may be a bug or tampering worth knowing about.
//!
//! Building reads the whole file once (decompressing frame by frame, in bounded memory) and
//! checks that every record is JSON, so a bad line is reported with its line and column when
//! the dataset is opened, not in the middle of an epoch.

use std::io::Read;
use std::path::Path;

use crate::error::{DataloadError, Result};

const MAGIC: &[u8; 8] = b"SKLINES\0";
const VERSION: u32 = 1;
const HEADER: usize = 64;
/// The largest index of a data file of `n` bytes (plain or compressed): each record holds at
/// least one byte and a newline (so at most `n / 2 + 1` records of the text), and a zstd file
/// of `n` bytes decodes to at most 128 KiB per byte of frames. Anything larger is not an index
/// of that file, and is not read.
pub(crate) fn max_index_len(data_len: u64, zstd: bool) -> u64 {
    let text = if zstd { data_len.saturating_mul(128 << 10) } else { data_len };
    let frames = if zstd { data_len / 9 + 1 } else { 0 };
    (HEADER as u64)
        .saturating_add(frames.saturating_mul(FRAME as u64))
        .saturating_add((text / 2 + 1).saturating_mul(LINE as u64))
}
const FRAME: usize = 24;
const LINE: usize = 16;

/// A zstd frame: its place in the file and where its output starts in the text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Frame {
    pub offset: u64,
    pub len: u64,
    pub text_start: u64,
}

/// What a stored index was built from: the kind of file, its size and modification time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Stamp {
    pub zstd: bool,
    pub source_size: u64,
    pub mtime: (u64, u32),
}

/// The index of one file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LineIndex {
    pub zstd: bool,
    pub source_size: u64,
    pub mtime: (u64, u32),
    pub text_len: u64,
    pub frames: Vec<Frame>,
    pub lines: Vec<(u64, u64)>,
}

/// Size and modification time of `path`, what an index is checked against.
pub(crate) fn stamp(path: &Path) -> Result<(u64, (u64, u32))> {
    let meta = std::fs::metadata(path).map_err(|e| DataloadError::io(path, e))?;
    let mtime = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map(|d| (d.as_secs(), d.subsec_nanos()))
        .unwrap_or((0, 0));
    Ok((meta.len(), mtime))
}

impl LineIndex {
    /// Text length of frame `k`.
    pub(crate) fn frame_text_len(&self, k: usize) -> u64 {
        let next = self.frames.get(k + 1).map_or(self.text_len, |f| f.text_start);
        next - self.frames[k].text_start
    }

    /// Builds the index of `data` (the whole file), checking every record is JSON.
    pub(crate) fn build(data: &[u8], zstd: bool, stamp: (u64, (u64, u32)), path: &Path) -> Result<Self> {
        let mut scan = Scanner { path, pos: 0, line_start: 0, line_no: 1, carry: Vec::new(), lines: Vec::new() };
        let mut frames = Vec::new();
        if zstd {
            let mut offset = 0usize;
            let mut chunk = vec![0u8; 1 << 18];
            while offset < data.len() {
                let corrupt = |reason: String| DataloadError::CorruptFrame {
                    path: path.to_owned(),
                    offset: offset as u64,
                    reason,
                };
                let rest = &data[offset..];
                let len = zstd::zstd_safe::find_frame_compressed_size(rest)
                    .map_err(|code| corrupt(zstd::zstd_safe::get_error_name(code).to_owned()))?;
                frames.push(Frame { offset: offset as u64, len: len as u64, text_start: scan.pos });
                let mut decoder = zstd::stream::read::Decoder::with_buffer(&rest[..len])
                    .map_err(|e| corrupt(e.to_string()))?
                    .single_frame();
                loop {
                    let n = decoder.read(&mut chunk).map_err(|e| corrupt(e.to_string()))?;
                    if n == 0 {
                        break;
                    }
                    scan.feed(&chunk[..n])?;
                }
                offset += len;
            }
        } else {
            scan.feed(data)?;
        }
        let text_len = scan.pos;
        let lines = scan.finish()?;
        Ok(Self { zstd, source_size: stamp.0, mtime: stamp.1, text_len, frames, lines })
    }

    /// The serialized index.
    pub(crate) fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEADER + self.frames.len() * FRAME + self.lines.len() * LINE);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&u32::from(self.zstd).to_le_bytes());
        for v in [self.source_size, self.mtime.0] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.extend_from_slice(&self.mtime.1.to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        for v in [self.text_len, self.frames.len() as u64, self.lines.len() as u64] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        for f in &self.frames {
            for v in [f.offset, f.len, f.text_start] {
                out.extend_from_slice(&v.to_le_bytes());
            }
        }
        for &(a, b) in &self.lines {
            out.extend_from_slice(&a.to_le_bytes());
            out.extend_from_slice(&b.to_le_bytes());
        }
        out
    }

    /// What the header of a stored index says about the file it indexes, or `None` when the
    /// bytes are not a line index of this version at all. This is what tells a stale index
    /// (rebuilt) from a corrupt one (refused): only the header is read.
    pub(crate) fn stored_stamp(b: &[u8]) -> Option<Stamp> {
        let u64_at = |at: usize| Some(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?));
        let u32_at = |at: usize| Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?));
        if b.len() < HEADER || b.get(..8)? != MAGIC || u32_at(8)? != VERSION {
            return None;
        }
        let zstd = match u32_at(12)? {
            0 => false,
            1 => true,
            _ => return None,
        };
        Some(Stamp { zstd, source_size: u64_at(16)?, mtime: (u64_at(24)?, u32_at(32)?) })
    }

    /// Parses and validates a serialized index (see the module docs for what is checked).
    pub(crate) fn from_bytes(b: &[u8]) -> std::result::Result<Self, String> {
        let u64_at = |at: usize| b.get(at..at + 8).map(|s| u64::from_le_bytes(s.try_into().unwrap_or([0; 8])));
        let u32_at = |at: usize| b.get(at..at + 4).map(|s| u32::from_le_bytes(s.try_into().unwrap_or([0; 4])));
        if b.len() < HEADER || &b[..8] != MAGIC {
            return Err("not a line index".into());
        }
        if u32_at(8) != Some(VERSION) {
            return Err("unknown version".into());
        }
        let kind = u32_at(12).unwrap_or(u32::MAX);
        let zstd = match kind {
            0 => false,
            1 => true,
            k => return Err(format!("unknown kind {k}")),
        };
        let field = |at: usize| u64_at(at).ok_or_else(|| "header cut off".to_string());
        let (source_size, secs, text_len, n_frames, n_lines) =
            (field(16)?, field(24)?, field(40)?, field(48)?, field(56)?);
        let nanos = u32_at(32).unwrap_or(0);
        let expected = usize::try_from(n_frames)
            .ok()
            .and_then(|f| f.checked_mul(FRAME))
            .zip(usize::try_from(n_lines).ok().and_then(|l| l.checked_mul(LINE)))
            .and_then(|(f, l)| f.checked_add(l)?.checked_add(HEADER));
        match expected {
            Some(n) if n == b.len() => {}
            Some(n) => return Err(format!("{} bytes where the counts call for {n}", b.len())),
            None => return Err(format!("{} bytes where the counts call for more than memory holds", b.len())),
        }
        // The length check above bounds both counts by the size of the index.
        let (n_frames, n_lines) = (n_frames as usize, n_lines as usize);
        let mut frames = Vec::with_capacity(n_frames);
        let (mut next_offset, mut last_start) = (0u64, 0u64);
        for k in 0..n_frames {
            let at = HEADER + k * FRAME;
            let f = Frame { offset: field(at)?, len: field(at + 8)?, text_start: field(at + 16)? };
            if f.offset != next_offset || f.text_start < last_start || f.text_start > text_len || f.len == 0 {
                return Err(format!("frame {k} is out of order"));
            }
            next_offset = f.offset.checked_add(f.len).ok_or("frame length overflows")?;
            last_start = f.text_start;
            frames.push(f);
        }
        if zstd && next_offset != source_size {
            return Err("frames do not cover the file".into());
        }
        // A reader finds the frame of a text offset by the frames' starts: the first frame must
        // start the text, and text without any frame has nowhere to come from.
        if zstd && frames.first().map_or(text_len != 0, |f| f.text_start != 0) {
            return Err(if frames.is_empty() {
                format!("no frames, but {text_len} bytes of text")
            } else {
                "frame 0 does not start the text".into()
            });
        }
        if !zstd && (n_frames != 0 || text_len != source_size) {
            return Err("a plain-text index has frames or another length".into());
        }
        let mut lines = Vec::with_capacity(n_lines);
        let mut prev_end = 0u64;
        let base = HEADER + n_frames * FRAME;
        for k in 0..n_lines {
            let (a, e) = (field(base + k * LINE)?, field(base + k * LINE + 8)?);
            // Records are never blank and a newline separates each from the next.
            if a < prev_end || (k > 0 && a == prev_end) || e < a {
                return Err(format!("line {k} is out of order"));
            }
            if e == a {
                return Err(format!("line {k} is empty"));
            }
            if e > text_len {
                return Err(format!("line {k} ends at byte {e}, past the end of the {text_len}-byte text"));
            }
            prev_end = e;
            lines.push((a, e));
        }
        Ok(Self { zstd, source_size, mtime: (secs, nanos), text_len, frames, lines })
    }

    /// Checks a plain-text index against the text itself: every record starts the file or
    /// follows a newline, and ends the file or a line (before its `\n` or `\r\n`). This
    /// costs two byte reads per record, not a scan, and catches an index whose numbers are
    /// well-formed but belong to other data.
    pub(crate) fn check_text(&self, text: &[u8]) -> std::result::Result<(), String> {
        let at = |i: u64| usize::try_from(i).ok().and_then(|i| text.get(i)).copied();
        let end = text.len() as u64;
        for (k, &(a, e)) in self.lines.iter().enumerate() {
            if a > 0 && at(a - 1) != Some(b'\n') {
                return Err(format!("line {k} does not start after a newline"));
            }
            let ends_line = e == end
                || at(e) == Some(b'\n')
                || (at(e) == Some(b'\r') && (e + 1 == end || at(e + 1) == Some(b'\n')));
            if !ends_line {
                return Err(format!("line {k} does not end at a newline"));
            }
        }
        Ok(())
    }

    /// Writes the index to `path` atomically, through [`crate::fs::write_atomic`]: a new
    /// temporary beside it under a name nobody can predict, created exclusively (a link planted
    /// beside the data file is never written through), fsynced, renamed.
    pub(crate) fn save(&self, path: &Path) -> std::io::Result<()> {
        crate::fs::write_atomic(path, &self.to_bytes())
    }
}

/// The deepest nesting of arrays and objects a record may have: serde_json's own limit when it
/// builds values, and far inside what Python's `json` (bounded by the interpreter's recursion
/// limit) reads.
pub(crate) const MAX_DEPTH: usize = 128;

/// The column (from 1) where `line` opens its `MAX_DEPTH + 1`-th nested array or object, if
/// it does; brackets inside strings do not count.
fn too_deep(line: &[u8]) -> Option<usize> {
    let (mut depth, mut in_string, mut escaped) = (0usize, false, false);
    for (i, &b) in line.iter().enumerate() {
        if in_string {
            match b {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'[' | b'{' => {
                depth += 1;
                if depth > MAX_DEPTH {
                    return Some(i + 1);
                }
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    None
}

/// Splits text fed in chunks into records, checking each is JSON.
struct Scanner<'p> {
    path: &'p Path,
    /// Text offset of the next byte fed.
    pos: u64,
    /// Text offset where the current line starts.
    line_start: u64,
    /// Number of the current line, from 1.
    line_no: u64,
    /// The current line's bytes fed so far, when it spans chunks.
    carry: Vec<u8>,
    lines: Vec<(u64, u64)>,
}

impl Scanner<'_> {
    fn feed(&mut self, mut chunk: &[u8]) -> Result<()> {
        while let Some(nl) = chunk.iter().position(|&b| b == b'\n') {
            let end = self.pos + nl as u64;
            if self.carry.is_empty() {
                self.record(&chunk[..nl], end)?;
            } else {
                let mut line = std::mem::take(&mut self.carry);
                line.extend_from_slice(&chunk[..nl]);
                self.record(&line, end)?;
                line.clear();
                self.carry = line;
            }
            self.pos = end + 1;
            self.line_start = self.pos;
            self.line_no += 1;
            chunk = &chunk[nl + 1..];
        }
        self.carry.extend_from_slice(chunk);
        self.pos += chunk.len() as u64;
        Ok(())
    }

    fn finish(mut self) -> Result<Vec<(u64, u64)>> {
        if !self.carry.is_empty() {
            let line = std::mem::take(&mut self.carry);
            self.record(&line, self.pos)?;
        }
        Ok(self.lines)
    }

    /// One line (without its newline) ending at text offset `end`.
    fn record(&mut self, line: &[u8], end: u64) -> Result<()> {
        let (line, end) = match line.strip_suffix(b"\r") {
            Some(l) => (l, end - 1),
            None => (line, end),
        };
        if line.iter().all(u8::is_ascii_whitespace) {
            return Ok(());
        }
        let not_json = |column: usize, reason: String| DataloadError::NotJson {
            path: self.path.to_owned(),
            line: self.line_no,
            column: column as u64,
            reason,
        };
        // serde_json skips over what it ignores without checking the text of strings or the
        // depth of nesting; a record must be one a JSON parser (Python's included) can read.
        if let Err(e) = std::str::from_utf8(line) {
            return Err(not_json(e.valid_up_to() + 1, "invalid UTF-8".into()));
        }
        if let Some(column) = too_deep(line) {
            return Err(not_json(column, format!("nested more than {MAX_DEPTH} levels deep")));
        }
        if let Err(e) = serde_json::from_slice::<serde::de::IgnoredAny>(line) {
            let text = e.to_string();
            let reason = text.rsplit_once(" at line ").map_or(text.as_str(), |(r, _)| r).to_owned();
            return Err(DataloadError::NotJson {
                path: self.path.to_owned(),
                line: self.line_no,
                column: e.column() as u64,
                reason,
            });
        }
        self.lines.push((self.line_start, end));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn round_trips_and_refuses_damage() {
        let text = b"{\"a\":1}\n\n{\"b\":2}\r\n[3]";
        let idx = LineIndex::build(text, false, (text.len() as u64, (5, 6)), Path::new("t")).unwrap();
        assert_eq!(idx.lines, vec![(0, 7), (9, 16), (18, 21)]);
        let bytes = idx.to_bytes();
        assert_eq!(LineIndex::from_bytes(&bytes).unwrap(), idx);
        let mut cut = bytes.clone();
        cut.pop();
        assert!(LineIndex::from_bytes(&cut).unwrap_err().contains("the counts call for"));
        let mut swapped = bytes;
        let at = HEADER;
        swapped[at] = 50; // the first line now starts after its end
        assert_eq!(LineIndex::from_bytes(&swapped).unwrap_err(), "line 0 is out of order");
    }

    #[test]
    fn every_line_ending_the_scanner_accepts_passes_the_text_check() {
        let text = b"  {\"a\":1}\r\n \t \n[2]\r\r\n\n\"x\"\n{}\r";
        let idx = LineIndex::build(text, false, (text.len() as u64, (0, 0)), Path::new("t")).unwrap();
        assert_eq!(idx.lines.len(), 4);
        idx.check_text(text).unwrap();
        let mut shifted = idx.clone();
        shifted.lines[3].1 -= 1;
        assert_eq!(shifted.check_text(text).unwrap_err(), "line 3 does not end at a newline");
    }
}
