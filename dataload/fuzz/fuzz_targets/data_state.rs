//! The document `ckpt data state --json` prints, of arbitrary loader state JSON: it parses back as
//! the same JSON.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    dataload::fuzz::data_state(data);
});
