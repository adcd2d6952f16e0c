//! fixtures/hostile/dataload: one malformed file per failure, each error pinned (file, row or
//! line, column, what is wrong); never a panic.
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;

use dataload::{DataloadError, IndexPlacement, JsonlDataset, ParquetDataset, Source, TokenDtype, TokenWindows};

fn hostile(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/hostile/dataload").join(name)
}

fn shown(name: &str) -> String {
    hostile(name).display().to_string()
}

#[test]
fn truncated_npy() {
    let err = TokenWindows::open(hostile("truncated.npy"), 16, TokenDtype::U16).unwrap_err();
    // numpy's header is 128 bytes; 1000 uint16 tokens need 2000 more; 600 are there.
    assert_eq!(err, DataloadError::Truncated { path: hostile("truncated.npy"), expected: 2128, found: 728 });
    assert_eq!(err.to_string(), format!("`{}` is truncated: 2128 bytes expected, 728 found", shown("truncated.npy")));
}

#[test]
fn truncated_bin() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("odd.bin");
    std::fs::write(&path, [1u8, 0, 2, 0, 3, 0, 4]).unwrap();
    let err = TokenWindows::open(&path, 2, TokenDtype::U16).unwrap_err();
    assert_eq!(err.to_string(), format!("`{}` is truncated: 8 bytes expected, 7 found", path.display()));
}

#[test]
fn wrong_dtype_npy() {
    let err = TokenWindows::open(hostile("wrong_dtype.npy"), 16, TokenDtype::U16).unwrap_err();
    assert_eq!(
        err.to_string(),
        format!(
            "`{}` holds `<f4`, but token files must hold one of `<u2`, `<u4`, `<i4`, `<i8`, `|u1`",
            shown("wrong_dtype.npy")
        )
    );
}

#[test]
fn missing_parquet_column() {
    let cols = ["id".to_string(), "text".to_string()];
    let err = ParquetDataset::open(hostile("no_text_column.parquet"), Some(&cols), 2).unwrap_err();
    assert_eq!(
        err.to_string(),
        format!("`{}` has no column `text` (it has: id, body)", shown("no_text_column.parquet"))
    );
}

#[test]
fn truncated_parquet() {
    let err = ParquetDataset::open(hostile("truncated.parquet"), None, 2).unwrap_err();
    let DataloadError::BadFormat { path, format, reason } = &err else { panic!("{err}") };
    assert_eq!((path.as_path(), *format), (hostile("truncated.parquet").as_path(), "parquet"));
    assert_eq!(reason, "Parquet error: Invalid Parquet file. Corrupt footer");
}

#[test]
fn corrupt_zstd_frame() {
    let tmp = tempfile::tempdir().unwrap();
    let err =
        JsonlDataset::open(hostile("corrupt_frame.jsonl.zst"), IndexPlacement::Dir(tmp.path().into()), 2).unwrap_err();
    // The second frame starts after the first (86 bytes, from the generator's expected.json).
    let DataloadError::CorruptFrame { path, offset, reason } = &err else { panic!("{err}") };
    assert_eq!((path.as_path(), *offset), (hostile("corrupt_frame.jsonl.zst").as_path(), 86));
    assert!(err
        .to_string()
        .starts_with(&format!("`{}`: corrupt zstd frame at byte 86: ", shown("corrupt_frame.jsonl.zst"))));
    assert!(!reason.is_empty());
    assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0, "no index is written for a bad file");
}

#[test]
fn line_that_is_not_json() {
    let err = JsonlDataset::open(hostile("not_json.jsonl"), IndexPlacement::Memory, 2).unwrap_err();
    assert_eq!(
        err.to_string(),
        format!("`{}`, line 4, column 10: not JSON: key must be a string", shown("not_json.jsonl"))
    );
}

#[test]
fn nothing_to_read() {
    let tmp = tempfile::tempdir().unwrap();
    let err = TokenWindows::open(tmp.path().join("*.bin"), 4, TokenDtype::U16).unwrap_err();
    assert_eq!(
        err.to_string(),
        format!("`{}` matches no data files (looked for `*.bin`, `*.npy`)", tmp.path().join("*.bin").display())
    );
    let err = TokenWindows::open(tmp.path().join("absent.bin"), 4, TokenDtype::U16).unwrap_err();
    assert!(matches!(err, DataloadError::Io { .. }), "{err}");
}

/// Writes `text` as `name` in a fresh directory and opens it once, which stores its line index
/// beside it; returns the directory, the data file and the index file.
fn indexed(name: &str, text: &[u8]) -> (tempfile::TempDir, PathBuf, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join(name);
    std::fs::write(&data, text).unwrap();
    let ds = JsonlDataset::open(&data, IndexPlacement::Beside, 2).unwrap();
    assert_eq!(ds.index_persisted(), [true]);
    let idx = tmp.path().join(format!("{name}.lines.idx"));
    (tmp, data, idx)
}

/// Sets the little-endian `u64` at `at` (offsets from the layout in `line_index.rs`).
fn put_u64(bytes: &mut [u8], at: usize, v: u64) {
    bytes[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

/// The header of a line index is 64 bytes; then frames (24 bytes each), then lines (16).
const HEADER: usize = 64;

fn corrupt_index_message(idx: &std::path::Path, data: &std::path::Path, reason: &str) -> String {
    format!(
        "`{}`: corrupt line index of `{}`: {reason}\nhint: delete the index file; it is rebuilt on the next open",
        idx.display(),
        data.display()
    )
}

#[test]
fn line_index_with_a_current_stamp_but_shifted_records() {
    // Well-formed numbers that belong to other data: the size and the time match, every
    // offset is in order and inside the file, but the second record starts one byte late.
    let (_tmp, data, idx) = indexed("data.jsonl", b"{\"a\": 1}\n{\"b\": 2}\n{\"c\": 3}\n");
    let mut bytes = std::fs::read(&idx).unwrap();
    put_u64(&mut bytes, HEADER + 16, 10);
    std::fs::write(&idx, &bytes).unwrap();
    let err = JsonlDataset::open(&data, IndexPlacement::Beside, 2).unwrap_err();
    assert_eq!(err.to_string(), corrupt_index_message(&idx, &data, "line 1 does not start after a newline"));
    assert!(matches!(&err, DataloadError::CorruptIndex { path, .. } if path == &idx), "{err}");
    assert_eq!(std::fs::read(&idx).unwrap(), bytes, "a refused index is left for inspection");
    // Deleting it is the way out.
    std::fs::remove_file(&idx).unwrap();
    let ds = JsonlDataset::open(&data, IndexPlacement::Beside, 2).unwrap();
    assert_eq!(ds.read_batch(&[1]).unwrap().get(0), Some("{\"b\": 2}"));
}

#[test]
fn line_index_with_a_current_stamp_but_overlapping_records() {
    let (_tmp, data, idx) = indexed("data.jsonl", b"{\"a\": 1}\n{\"b\": 2}\n");
    let mut bytes = std::fs::read(&idx).unwrap();
    // The second record now starts inside the first.
    put_u64(&mut bytes, HEADER + 16, 3);
    std::fs::write(&idx, &bytes).unwrap();
    let err = JsonlDataset::open(&data, IndexPlacement::Beside, 2).unwrap_err();
    assert_eq!(err.to_string(), corrupt_index_message(&idx, &data, "line 1 is out of order"));
}

#[test]
fn zstd_line_index_without_frames() {
    // An empty `.jsonl.zst` has no frames; its index, told it has text and a record, used to
    // send the reader looking for frame 0 of none.
    let (_tmp, data, idx) = indexed("empty.jsonl.zst", b"");
    let mut bytes = std::fs::read(&idx).unwrap();
    assert_eq!(bytes.len(), HEADER);
    put_u64(&mut bytes, 40, 10); // text_len
    put_u64(&mut bytes, 56, 1); // n_lines
    bytes.extend_from_slice(&0u64.to_le_bytes());
    bytes.extend_from_slice(&5u64.to_le_bytes());
    std::fs::write(&idx, &bytes).unwrap();
    let err = JsonlDataset::open(&data, IndexPlacement::Beside, 2).unwrap_err();
    assert_eq!(err.to_string(), corrupt_index_message(&idx, &data, "no frames, but 10 bytes of text"));
}

/// The first record batch of an IPC file: where its body starts, and its message's buffers.
fn first_batch_buffers(bytes: &[u8]) -> (usize, Vec<(usize, usize)>) {
    let n = bytes.len();
    let footer_len = i32::from_le_bytes(bytes[n - 10..n - 6].try_into().unwrap()) as usize;
    let footer = arrow_ipc::root_as_footer(&bytes[n - 10 - footer_len..n - 10]).unwrap();
    let block = footer.recordBatches().unwrap().get(0);
    let (off, meta_len) = (block.offset() as usize, block.metaDataLength() as usize);
    let message = arrow_ipc::root_as_message(&bytes[off + 8..off + meta_len]).unwrap();
    let batch = message.header_as_record_batch().unwrap();
    assert!(batch.compression().is_some(), "a compressed fixture");
    let buffers = batch.buffers().unwrap().iter().map(|b| (b.offset() as usize, b.length() as usize)).collect();
    (off + meta_len, buffers)
}

#[test]
fn a_compressed_arrow_buffer_declaring_exabytes_is_refused_before_anything_is_allocated() {
    // An IPC file's compressed buffer starts with its length once decompressed, which arrow
    // allocates before decompressing: a real zstd file with one such length raised to 2^60.
    for stream in [false, true] {
        let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/dataload_sources/table_zstd.arrow");
        let mut bytes = std::fs::read(&src).unwrap();
        let (body, buffers) = first_batch_buffers(&bytes);
        let (at, _) = buffers.iter().copied().find(|(_, len)| *len >= 8).unwrap();
        bytes[body + at..body + at + 8].copy_from_slice(&(1i64 << 60).to_le_bytes());
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join(if stream { "bomb.arrows" } else { "bomb.arrow" });
        if stream {
            // The same messages without the file's magic and footer: an IPC stream.
            let n = bytes.len();
            let footer_len = i32::from_le_bytes(bytes[n - 10..n - 6].try_into().unwrap()) as usize;
            bytes = bytes[8..n - 10 - footer_len].to_vec();
        }
        std::fs::write(&path, &bytes).unwrap();
        let err = match dataload::ArrowDataset::open(&path, None) {
            Err(e) => e,
            // The file form finds it when the batch is read.
            Ok(ds) => ds.read_batch(&[0]).unwrap_err(),
        };
        let text = err.to_string();
        assert!(
            text.contains(&path.display().to_string())
                && text.contains("a compressed record batch declares 11529215046068")
                && text.contains("refused"),
            "{text}"
        );
    }
}

#[test]
fn a_panic_inside_arrows_decoder_is_an_error() {
    // Found by the arrow_ipc fuzz target: an IPC stream whose int32 offsets buffer has a length
    // that is not a multiple of 4. Our checks let it through; arrow's validation asserts on it,
    // and the reader returns that as an error naming the file.
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fuzz_regressions/arrow_ipc_offsets_length.arrows");
    let err = match dataload::ArrowDataset::open(&path, None) {
        Err(e) => e,
        Ok(ds) => ds.read_batch(&[0]).unwrap_err(),
    };
    let text = err.to_string();
    assert!(text.contains(&path.display().to_string()) && text.contains("arrow's decoder failed on it"), "{text}");
}
