//! The restricted unpickler and the state-dict walk on arbitrary bytes: never a panic, a hang
//! or an unbounded allocation.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    ckpt::fuzz::unpickle(data);
});
