//! The tiling check on arbitrary boxes: never a panic, and bounded time and memory.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    ckpt::fuzz::tiling(data);
});
