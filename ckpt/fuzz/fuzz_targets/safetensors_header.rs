//! The safetensors header parser and validator on arbitrary bytes: never a panic or an
//! unbounded allocation.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    ckpt::fuzz::safetensors_header(data);
});
