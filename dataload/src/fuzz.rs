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

/// A mixture's definition, as `ckpt data state --mixture MIX.json` and a loader state carry it:
/// parsed, and when accepted written back and parsed again (the same definition), compiled, and
/// when it compiles located at a few positions, its sources' counts checked against the
/// positions, then read by a loader as the tool reads it, whose state survives its own JSON.
pub fn mixture_spec(input: &[u8]) {
    let Ok(spec) = serde_json::from_slice::<crate::MixtureSpec>(input) else { return };
    let text = serde_json::to_string(&spec).expect("a definition renders");
    assert_eq!(serde_json::from_str::<crate::MixtureSpec>(&text).ok().as_ref(), Some(&spec), "{text}");
    let Ok(m) = crate::Mixture::new(spec.clone()) else { return };
    let len = m.len();
    let probes: Vec<u64> = [0, 1, len / 2, len.saturating_sub(1)].into_iter().filter(|&p| p < len).collect();
    let located: Vec<(usize, u64)> =
        probes.iter().map(|&p| m.locate(p).expect("a position of the mixture locates")).collect();
    assert_eq!(m.locate_many(&probes).ok().as_ref(), Some(&located));
    for &(src, i) in &located {
        assert!(i < spec.sizes[src], "sample {i} of source {src}, which has {}", spec.sizes[src]);
    }
    for p in probes.iter().copied().chain([len]) {
        let given = m.positions(p).expect("a position up to the end has counts");
        assert_eq!(given.iter().try_fold(0u64, |t, &c| t.checked_add(c)), Some(p), "counts at {p}: {given:?}");
    }
    assert!(m.locate(len).is_err(), "position {len} is past the end");
    if let Some(past) = len.checked_add(1) {
        assert!(m.positions(past).is_err(), "position {past} is past the end");
    }
    let Ok(loader) =
        crate::ShardedSampler::builder().dataset_len(len).batch_size(4).world_size(2).mixture(spec).build()
    else {
        return;
    };
    let state = loader.state_dict();
    let again = state.to_json().map(|t| crate::LoaderState::from_json(&t));
    assert!(matches!(&again, Ok(Ok(s)) if *s == state), "a state does not survive its own JSON: {again:?}");
}

/// The document `ckpt data state --json` prints, of a loader state JSON (with or without a
/// mixture): built by [`crate::StateReport`], printed as the tool prints it, it parses back as
/// the same JSON; its text form renders too.
pub fn data_state(input: &[u8]) {
    let Ok(text) = std::str::from_utf8(input) else { return };
    let Ok(state) = crate::LoaderState::from_json(text) else { return };
    // The report resumes the state on each of its ranks: a world and a dataset of a size a
    // fuzzer can afford.
    if state.dataset_len > 1 << 16 || state.world_size > 8 {
        return;
    }
    let Ok(report) = crate::StateReport::new(&state) else { return };
    let printed = serde_json::to_string_pretty(&report).expect("the report renders");
    let parsed: serde_json::Value = serde_json::from_str(&printed).expect("the printed report is JSON");
    assert_eq!(parsed, serde_json::to_value(&report).expect("the report renders"), "{printed}");
    assert_eq!(parsed["ranks"].as_array().map(Vec::len), Some(report.ranks.len()));
    let _ = report.to_string();
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

    /// A mixture definition of each kind, and each with a field edited: refused, or compiled and
    /// located consistently (what the fuzz target checks, here on every `cargo test`); and the
    /// `ckpt data state` document of a loader part way into each.
    #[test]
    fn mixtures_and_their_states_survive_edits() {
        let specs = [
            r#"{"sizes": [1000, 200, 5000], "weights": [0.6, 0.3, 0.1], "seed": 3, "once": [1], "length": 4000}"#,
            r#"{"sizes": [13, 29], "weights": [1.0, 3.0], "seed": 0, "once": [0, 1]}"#,
            r#"{"sizes": [50, 70], "weights": [0.5, 0.5], "seed": 9, "length": 500,
                "changes": [{"at": 100, "weights": [0.1, 0.9]}, {"at": 300, "weights": [1.0, 1.0]}]}"#,
        ];
        let edits = [("0.6", "1e-300"), ("3", "18446744073709551615"), ("[1]", "[7]"), ("4000", "0"), ("500", "99")];
        for spec in specs {
            mixture_spec(spec.as_bytes());
            for (from, to) in edits {
                mixture_spec(spec.replacen(from, to, 1).as_bytes());
            }
            let spec: crate::MixtureSpec = serde_json::from_str(spec).unwrap();
            let len = crate::Mixture::new(spec.clone()).unwrap().len();
            let mut l = crate::ShardedSampler::builder()
                .dataset_len(len)
                .batch_size(4)
                .world_size(3)
                .mixture(spec)
                .build()
                .unwrap();
            l.next_batch().unwrap();
            let state = l.state_dict().to_json().unwrap();
            data_state(state.as_bytes());
            loader_state(state.as_bytes());
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
