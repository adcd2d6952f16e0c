//! Entry points for the fuzz targets (`ckpt/fuzz`): each parser on arbitrary bytes. None may
//! panic, hang or allocate without bound, whatever the input; errors are the expected outcome.

use std::path::Path;

pub use crate::formats::torch::fuzz::*;

/// The DCP `.metadata` reader: the restricted unpickler with DCP's classes, then the walk over
/// its dataclasses.
pub fn dcp_metadata(data: &[u8]) {
    let _ = crate::formats::dcp::metadata::parse(data, Path::new("fuzz/.metadata"));
}

/// A Hugging Face index (`model.safetensors.index.json`): JSON, `metadata`, `weight_map`
/// entries and their file-name check.
pub fn hf_index(data: &[u8]) {
    let _ = crate::formats::hf_index::Index::parse(data, Path::new("fuzz/model.safetensors.index.json"));
}

/// A safetensors header: the length prefix, the JSON, every entry and the offset rules, then
/// the catalog built on it.
pub fn safetensors_header(data: &[u8]) {
    let Some((n, json)) = data.split_first_chunk::<8>() else { return };
    let header_len = u64::from_le_bytes(*n);
    if header_len > crate::formats::safetensors::MAX_HEADER_LEN || header_len > json.len() as u64 {
        return;
    }
    let path = Path::new("fuzz.safetensors");
    let Some(json) = json.get(..header_len as usize) else { return };
    if let Ok(header) = crate::formats::safetensors::parse_header(json, header_len, path) {
        let _ = crate::formats::safetensors::header_tensors(header, 0);
    }
}

/// The check that a tensor's boxes tile it (every format's DCP chunks, shards, views): the
/// first byte is the number of dims (up to 4), then one byte per dim of the shape, then boxes
/// as one offset and one size byte per dim. It must answer, in bounded time and memory, for any
/// set of boxes.
pub fn tiling(data: &[u8]) {
    let Some((&dims, rest)) = data.split_first() else { return };
    let dims = usize::from(dims % 5);
    let Some((shape, rest)) = rest.split_at_checked(dims) else { return };
    let shape: Vec<u64> = shape.iter().map(|&d| u64::from(d % 64)).collect();
    let boxes: Vec<fsdp_state::Region> = rest
        .chunks_exact((2 * dims).max(1))
        .map(|b| {
            let (o, s) = b.split_at(dims.min(b.len()));
            fsdp_state::Region::new(
                o.iter().map(|&x| u64::from(x % 65)).collect::<Vec<_>>(),
                s.iter().map(|&x| u64::from(x % 65)).collect::<Vec<_>>(),
            )
        })
        .collect();
    let _ = fsdp_state::check_tiling(&shape, &boxes);
}
