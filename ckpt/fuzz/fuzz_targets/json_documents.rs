//! The JSON documents `ckpt --json` prints, built from arbitrary names, dtypes, shapes, metadata
//! and values: the printed text parses back as the same document.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    ckpt::fuzz::json_documents(data);
});
