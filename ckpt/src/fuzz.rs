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
