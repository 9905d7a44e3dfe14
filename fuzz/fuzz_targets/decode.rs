//! Any bytes given to the adapter decoder as a `.zst`: an error or a valid
//! safetensors file, never a panic.
#![no_main]

use std::path::Path;

use adapter_codec::{decode_stream, Ends};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut out = Vec::new();
    let ends = Ends { source: Path::new("fuzz.zst"), sink: Path::new("out") };
    if decode_stream(&mut &data[..], &mut out, ends, &mut |_, _| {}).is_ok() {
        st_mmap::parse_header(&out, out.len() as u64).expect("decoded output must be valid");
    }
});
