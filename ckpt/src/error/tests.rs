use super::*;

/// The variant's name as `Debug` writes it: what precedes its fields.
fn debug_head(e: &Error) -> String {
    let debug = format!("{e:?}");
    debug.split([' ', '{', '(']).next().unwrap_or_default().to_string()
}

#[test]
fn variant_name_is_the_debug_name() {
    let errors = [
        Error::Io { path: "a.safetensors".into(), source: std::io::Error::other("boom") },
        Error::HeaderTooSmall { path: "a.safetensors".into(), len: 3 },
        Error::NotACheckpoint { path: "nowhere".into() },
        Error::UnknownSafetensorsLayout { path: "dir".into(), count: 2, found: vec!["x.safetensors".into()] },
        Error::BadChecksum {
            path: "model.pt".into(),
            tensor: None,
            rank: None,
            record: "archive/data/0".into(),
            item: None,
            stored: 1,
            actual: 2,
        },
        Error::BadOption { option: "allow_globals", reason: "no".into() },
        Error::Collective {
            dir: "out".into(),
            source: collective::CollectiveError::NoSuchRoot { op: "broadcast", rank: 0, root: 3, world_size: 2 },
        },
        Error::OtherRank { rank: 1 },
        Error::BadMegatron { path: "ckpt".into(), key: Some("k".into()), rank: Some(0), reason: "r".into() },
    ];
    for e in &errors {
        assert_eq!(e.variant_name(), debug_head(e), "{e:?}");
    }
}
