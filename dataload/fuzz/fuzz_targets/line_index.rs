//! The stored line index of a JSON-lines file on arbitrary bytes, taken as current for an
//! arbitrary data file, then every read through it: refused or read, never a panic.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    dataload::fuzz::line_index(data);
});
