//! Any bytes given to the safetensors header parser: an error or a header
//! whose tensors tile the data section, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(header) = st_mmap::parse_header(data, data.len() as u64) {
        let mut end = 0;
        for t in header.tensors() {
            assert_eq!(t.data_offsets.0, end);
            end = t.data_offsets.1;
        }
        assert_eq!(header.data_start() + end, data.len());
    }
});
