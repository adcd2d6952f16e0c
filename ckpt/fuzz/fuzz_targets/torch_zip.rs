//! The zip reader of `torch.save` archives on arbitrary bytes, then the pickle it finds.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    ckpt::fuzz::torch_zip(data);
});
