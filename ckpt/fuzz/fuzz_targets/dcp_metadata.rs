//! The DCP `.metadata` reader on arbitrary bytes: never a panic, a hang or an unbounded
//! allocation, whatever the pickle and the dataclass fields it builds.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    ckpt::fuzz::dcp_metadata(data);
});
