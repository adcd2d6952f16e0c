//! A mixture's definition (`MixtureSpec` JSON, what `ckpt data state --mixture` reads) on arbitrary
//! bytes: refused, or compiled and located consistently, never a panic or a hang.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    dataload::fuzz::mixture_spec(data);
});
