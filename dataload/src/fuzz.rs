//! Entry points for the fuzz targets in `dataload/fuzz/`: each runs a parser of untrusted
//! bytes the way the crate does and must never panic, hang or allocate out of proportion to
//! its input. Not part of the API.

/// The stored line index reader. The input is a flag byte (bit 0: zstd), a little-endian
/// `u16` data length, that many bytes of data file, then the index file. The index is taken
/// as current (its own modification time, the data's size), so the fuzzer reaches validation
/// and the reads through a validated index; a stale one is rebuilt from the data and read.
#[cfg(feature = "sources")]
pub fn line_index(input: &[u8]) {
    let Some((&flags, rest)) = input.split_first() else { return };
    let Some((len, rest)) = rest.split_first_chunk::<2>() else { return };
    let (data, index) = rest.split_at(usize::from(u16::from_le_bytes(*len)).min(rest.len()));
    crate::jsonl::fuzz_read(data, index, flags & 1 == 1);
}

/// A seed for [`line_index`]: `data` (cut to what the input format holds) with the index
/// this crate builds for it, or `None` when `data` does not index (`run.sh` seeds the corpus
/// with these, through `examples/fuzz_seeds.rs`).
#[cfg(feature = "sources")]
pub fn line_index_seed(data: &[u8], zstd: bool) -> Option<Vec<u8>> {
    let data = &data[..data.len().min(usize::from(u16::MAX))];
    let index = crate::line_index::LineIndex::build(data, zstd, (data.len() as u64, (0, 0)), "seed".as_ref()).ok()?;
    let len = u16::try_from(data.len()).ok()?;
    let mut out = vec![u8::from(zstd)];
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&index.to_bytes());
    Some(out)
}

/// An Arrow IPC file (or stream) on arbitrary bytes: its footer, its blocks and the messages
/// they point at are validated, then every record batch is decoded (decompressed when its body
/// is compressed) and a few rows are gathered. Refused or read, never a panic: the checks of
/// `arrow_file` run before arrow slices anything, and a panic inside arrow is an error there.
#[cfg(feature = "sources")]
pub fn arrow_ipc(input: &[u8]) {
    crate::arrow_file::fuzz_read(input);
}

/// `LoaderState` JSON: parsed, and when accepted written back and parsed again (the same
/// state), then resumed on a small world and read for a few batches when the dataset is small
/// enough to permute.
pub fn loader_state(input: &[u8]) {
    let Ok(text) = std::str::from_utf8(input) else { return };
    let Ok(state) = crate::LoaderState::from_json(text) else { return };
    let again = state.to_json().map(|t| crate::LoaderState::from_json(&t));
    assert!(matches!(&again, Ok(Ok(s)) if *s == state), "a state does not survive its own JSON: {again:?}");
    if state.dataset_len > 1 << 16 {
        return;
    }
    for world in [1, 2, state.world_size.min(8)] {
        let Ok(mut loader) = crate::ShardedSampler::from_state(&state, world, world - 1) else { continue };
        for _ in 0..4 {
            if !matches!(loader.next_batch(), Ok(Some(_))) {
                break;
            }
        }
        let _ = loader.state_dict();
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// Every cut and every flipped byte of the index of each fixture: refused or read, and
    /// never a panic (what the fuzz target checks, here on every `cargo test`).
    #[cfg(feature = "sources")]
    #[test]
    fn line_index_survives_cut_and_flipped_fixture_indexes() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/dataload_sources");
        for name in ["lines.jsonl", "lines.jsonl.zst", "lines_one_frame.jsonl.zst"] {
            let data = std::fs::read(dir.join(name)).unwrap();
            let seed = line_index_seed(&data, name.ends_with(".zst")).unwrap();
            let index_at = 3 + data.len();
            line_index(&seed);
            for cut in index_at..seed.len() {
                line_index(&seed[..cut]);
            }
            for at in index_at..seed.len() {
                let mut flipped = seed.clone();
                flipped[at] ^= 0x5a;
                line_index(&flipped);
            }
        }
    }

    /// Cuts of each Arrow fixture, and every byte of its first 2 KiB and its last 512 bytes (the
    /// footer and the messages: the metadata a reader trusts) edited: refused or read, and no
    /// panic ever leaves the reader (what the fuzz target checks, here on every `cargo test`).
    #[cfg(feature = "sources")]
    #[test]
    fn arrow_ipc_survives_cut_and_flipped_fixtures() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/dataload_sources");
        let survives = |data: &[u8]| {
            let caught = std::panic::catch_unwind(|| arrow_ipc(data));
            assert!(caught.is_ok(), "a panic left the Arrow reader");
        };
        for name in ["table.arrow", "table_zstd.arrow", "table_lz4.arrow", "table.arrows"] {
            let data = std::fs::read(dir.join(name)).unwrap();
            survives(&data);
            for cut in (0..data.len()).step_by(31) {
                survives(&data[..cut]);
            }
            let edited_at = (0..data.len().min(2048)).chain(data.len().saturating_sub(512)..data.len());
            for at in edited_at {
                let mut edited = data.clone();
                edited[at] = if at % 2 == 0 { 0xff } else { data[at] ^ 0x5a };
                survives(&edited);
            }
        }
    }

    #[test]
    fn loader_state_survives_edited_states() {
        let state = crate::ShardedSampler::builder().dataset_len(10).batch_size(3).world_size(2).build().unwrap();
        let text = state.state_dict().to_json().unwrap();
        loader_state(text.as_bytes());
        for (from, to) in
            [("\"cursor\": 0", "\"cursor\": 9"), ("\"world_size\": 2", "\"world_size\": 18446744073709551615")]
        {
            loader_state(text.replace(from, to).as_bytes());
        }
    }
}
