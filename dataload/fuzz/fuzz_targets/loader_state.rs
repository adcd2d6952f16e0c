//! `LoaderState` JSON on arbitrary bytes: refused, or a state that survives its own JSON and
//! resumes without a panic.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    dataload::fuzz::loader_state(data);
});
