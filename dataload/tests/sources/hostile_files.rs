//! Files that are hostile by what they are or what happens to them, rather than by their
//! bytes alone: a link planted where the line index is written, special files in place of
//! data files, a token file truncated while open, Arrow messages whose buffers lie outside
//! their body, JSON lines no parser reads. Each is refused by name, with the message pinned;
//! never a panic, a hang, a fault or a write through the link.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use dataload::{
    ArrowDataset, DataloadError, IndexPlacement, JsonlDataset, ParquetDataset, Source, TokenDtype, TokenWindows,
};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/dataload_sources").join(name)
}

#[test]
fn a_link_planted_at_the_old_temporary_name_of_the_line_index_is_not_written_through() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data.jsonl");
    std::fs::write(&data, b"{\"a\": 1}\n{\"b\": 2}\n").unwrap();
    let victim = tmp.path().join("victim.txt");
    std::fs::write(&victim, b"precious").unwrap();
    // The name the index used to be written through: predictable, opened create-and-truncate.
    let planted = tmp.path().join(format!("data.jsonl.lines.idx.tmp{}", std::process::id()));
    std::os::unix::fs::symlink(&victim, &planted).unwrap();
    let ds = JsonlDataset::open(&data, IndexPlacement::Beside, 2).unwrap();
    assert_eq!(ds.index_persisted(), [true]);
    assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
    assert!(std::fs::symlink_metadata(&planted).unwrap().file_type().is_symlink(), "the link is left as it was");
    let names: Vec<String> =
        std::fs::read_dir(tmp.path()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    let mut names = names;
    names.sort();
    let expected = ["data.jsonl", "data.jsonl.lines.idx", planted.file_name().unwrap().to_str().unwrap(), "victim.txt"];
    assert_eq!(names, expected, "nothing but the index is written");
}

/// Opens `path` with each source on a thread and returns the errors, failing if any open takes
/// more than a few seconds (a FIFO opened for reading blocks until a writer comes).
fn open_all(path: &Path) -> Vec<String> {
    let path = path.to_path_buf();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let errors = vec![
            TokenWindows::open(&path, 4, TokenDtype::U16).map(|_| ()).unwrap_err().to_string(),
            ArrowDataset::open(&path, None).map(|_| ()).unwrap_err().to_string(),
            ParquetDataset::open(&path, None, 2).map(|_| ()).unwrap_err().to_string(),
            JsonlDataset::open(&path, IndexPlacement::Memory, 2).map(|_| ()).unwrap_err().to_string(),
        ];
        let _ = tx.send(errors);
    });
    let started = Instant::now();
    let errors = rx.recv_timeout(Duration::from_secs(20)).expect("opening a special file hangs");
    assert!(started.elapsed() < Duration::from_secs(20));
    errors
}

#[test]
fn special_files_in_place_of_data_files_are_refused_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    let fifo = tmp.path().join("tokens.bin");
    let made = std::process::Command::new("mkfifo").arg(&fifo).status().unwrap();
    assert!(made.success());
    let zero = tmp.path().join("zero.bin");
    std::os::unix::fs::symlink("/dev/zero", &zero).unwrap();
    for (path, kind) in [(&fifo, "a FIFO"), (&zero, "a device")] {
        let want = format!("`{}`: is {kind}, not a regular file; refusing to read it", path.display());
        for err in open_all(path) {
            assert_eq!(err, want);
        }
    }
}

#[test]
fn a_token_file_truncated_after_it_was_opened_is_an_error_not_a_fault() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("tokens.bin");
    let tokens: Vec<u8> = (0u16..4096).flat_map(u16::to_le_bytes).collect();
    std::fs::write(&path, &tokens).unwrap();
    let ds = TokenWindows::open(&path, 16, TokenDtype::U16).unwrap();
    assert_eq!(ds.read_batch(&[0]).unwrap().input(0)[1], 1);
    std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(64).unwrap();
    let err = ds.read_batch(&[200]).unwrap_err();
    assert_eq!(err, DataloadError::FileChanged { path: path.clone() });
    assert_eq!(err.to_string(), format!("`{}`: the file changed while opened", path.display()));
    // What is still there is still read.
    assert_eq!(ds.read_batch(&[0]).unwrap().target(0)[0], 1);
}

#[test]
fn mapped_sources_refuse_a_file_that_shrank_since_it_was_opened() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("table.arrow");
    std::fs::copy(fixture("table.arrow"), &path).unwrap();
    let ds = ArrowDataset::open(&path, None).unwrap();
    std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(100).unwrap();
    let err = ds.read_batch(&[0]).unwrap_err();
    assert_eq!(err.to_string(), format!("`{}`: the file changed while opened", path.display()));

    let path = tmp.path().join("data.jsonl");
    std::fs::write(&path, b"{\"a\": 1}\n{\"b\": 2}\n").unwrap();
    let ds = JsonlDataset::open(&path, IndexPlacement::Memory, 2).unwrap();
    std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(3).unwrap();
    assert_eq!(ds.read_batch(&[1]).unwrap_err(), DataloadError::FileChanged { path });
}

/// The IPC file `table.arrow` with buffer `k` of its first record batch given `offset` and
/// `len` (the flatbuffer `Buffer` structs are inline: 16 bytes each, offset then length).
fn arrow_with_buffer(k: usize, offset: Option<i64>, len: Option<i64>) -> Vec<u8> {
    let mut bytes = std::fs::read(fixture("table.arrow")).unwrap();
    let n = bytes.len();
    let footer_len = i32::from_le_bytes(bytes[n - 10..n - 6].try_into().unwrap()) as usize;
    let footer = arrow_ipc::root_as_footer(&bytes[n - 10 - footer_len..n - 10]).unwrap();
    let block = footer.recordBatches().unwrap().get(0);
    let (off, meta_len) = (block.offset() as usize, block.metaDataLength() as usize);
    let message = arrow_ipc::root_as_message(&bytes[off + 8..off + meta_len]).unwrap();
    let buffers = message.header_as_record_batch().unwrap().buffers().unwrap();
    let at = buffers.bytes().as_ptr() as usize - bytes.as_ptr() as usize + 16 * k;
    if let Some(o) = offset {
        bytes[at..at + 8].copy_from_slice(&o.to_le_bytes());
    }
    if let Some(l) = len {
        bytes[at + 8..at + 16].copy_from_slice(&l.to_le_bytes());
    }
    bytes
}

#[test]
fn an_arrow_buffer_outside_its_body_is_refused_before_arrow_slices_it() {
    let tmp = tempfile::tempdir().unwrap();
    let cases = [
        (
            "len_2_62.arrow",
            arrow_with_buffer(1, None, Some(1 << 62)),
            "buffer 1 at body offset 0 (4611686018427387904 bytes)",
        ),
        (
            "wraps.arrow",
            arrow_with_buffer(1, Some(i64::MAX), Some(i64::MAX)),
            "buffer 1 at body offset 9223372036854775807 (9223372036854775807 bytes)",
        ),
        ("negative.arrow", arrow_with_buffer(1, Some(-8), None), "buffer 1 at body offset -8"),
    ];
    for (name, bytes, what) in cases {
        let path = tmp.path().join(name);
        std::fs::write(&path, bytes).unwrap();
        let err = ArrowDataset::open(&path, None).unwrap_err().to_string();
        let prefix = format!("`{}`: malformed arrow ipc: {what}", path.display());
        assert!(err.starts_with(&prefix) && err.contains("lies outside the") && err.ends_with("-byte body"), "{err}");
    }
}

#[test]
fn json_lines_no_parser_reads_are_refused_at_open_with_their_line() {
    let tmp = tempfile::tempdir().unwrap();
    let cases: [(&str, Vec<u8>, &str); 2] = [
        ("utf8.jsonl", b"{\"a\": 1}\n\n{\"b\": \"\xff\xfe\"}\n".to_vec(), "line 3, column 8: not JSON: invalid UTF-8"),
        (
            "deep.jsonl",
            [b"{\"a\": 1}\n".to_vec(), vec![b'['; 100_000], vec![b']'; 100_000]].concat(),
            "line 2, column 129: not JSON: nested more than 128 levels deep",
        ),
    ];
    for (name, text, what) in cases {
        let path = tmp.path().join(name);
        std::fs::write(&path, text).unwrap();
        let err = JsonlDataset::open(&path, IndexPlacement::Memory, 2).unwrap_err();
        assert_eq!(err.to_string(), format!("`{}`, {what}", path.display()));
    }
}

#[test]
fn a_record_is_found_by_its_line() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("data.jsonl");
    std::fs::write(&path, b"{\"a\": 1}\n\n\n{\"b\": 2}\n{\"c\": 3}\n").unwrap();
    let ds = JsonlDataset::open(&path, IndexPlacement::Memory, 2).unwrap();
    assert_eq!(ds.record_line(1).unwrap(), (path.clone(), 4));
    assert_eq!(ds.record_line(2).unwrap(), (path, 5));
    let zst = fixture("lines.jsonl.zst");
    let ds = JsonlDataset::open(&zst, IndexPlacement::Memory, 2).unwrap();
    let plain = JsonlDataset::open(fixture("lines.jsonl"), IndexPlacement::Memory, 2).unwrap();
    for i in [0, ds.len() / 2, ds.len() - 1] {
        assert_eq!(ds.record_line(i).unwrap().1, plain.record_line(i).unwrap().1);
    }
}
