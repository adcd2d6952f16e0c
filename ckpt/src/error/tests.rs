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
        Error::DestinationLocked { dst: "out".into(), lock: ".out.lock".into(), pid: Some(7) },
        Error::DestinationsDiffer { dst: "out".into(), rank: 1, other: "out1".into() },
        Error::BadMegatron { path: "ckpt".into(), key: Some("k".into()), rank: Some(0), reason: "r".into() },
        Error::MissingMegatronRank { path: "ckpt".into(), rank: 1, tp: 2, pp: 1 },
        Error::BadModelMap {
            path: "ckpt".into(),
            tensor: "w".into(),
            problem: Box::new(MapProblem::Unplaced { view: "one-rank model" }),
        },
        Error::MissingRngFile { path: "random_states_1.pkl".into(), rank: 1, world: 2 },
        Error::ZeroDtype {
            path: "zero_pp_rank_0_mp_rank_00_optim_states.pt".into(),
            rank: 0,
            tensor: "k".into(),
            found: crate::Dtype::F16,
            expected: crate::Dtype::F32,
        },
        Error::RankBeyondLimit { path: "random_states_9999999.pkl".into(), limit: crate::MAX_WORLD_SIZE },
        Error::DcpItemDtype {
            path: "__0_0.distcp".into(),
            tensor: "w".into(),
            rank: Some(0),
            at: 0,
            found: crate::Dtype::F64,
            expected: crate::Dtype::F32,
        },
        Error::BoxDtypeMismatch {
            path: "shard.safetensors".into(),
            tensor: "w".into(),
            rank: None,
            found: crate::Dtype::F64,
            other: crate::Dtype::F32,
        },
        Error::DcpMetadataTooLarge {
            path: ".metadata".into(),
            len: 2,
            cap: 1,
            files: 0,
            data_len: 0,
            items: 0,
            min_item_len: 1,
            per_item: 1,
            min_cap: 1,
        },
        Error::HubAuth { repo: "o/n".into(), file: "f".into(), status: 401, token_source: None, write: false },
        Error::HubNotFound { repo: "o/n".into(), revision: "main".into(), file: None, endpoint: "http://h".into() },
        Error::HubRequest { url: "http://h/o/n".into(), reason: "r".into() },
        Error::HubCorrupt { repo: "o/n".into(), file: "f".into(), reason: "r".into() },
    ];
    for e in &errors {
        assert_eq!(e.variant_name(), debug_head(e), "{e:?}");
    }
}

/// A refused token is named by where it came from, never by its value, and the advice fits a
/// read or a push.
#[test]
fn hub_auth_messages_name_the_variable_to_set() {
    let read = Error::HubAuth {
        repo: "o/n".into(),
        file: "model.safetensors".into(),
        status: 401,
        token_source: None,
        write: false,
    };
    assert_eq!(
        read.to_string(),
        "`o/n`: the Hub answered 401 for `model.safetensors`; the repository is gated or private: set `HF_TOKEN` \
         (or save a token in `$HF_HOME/token`) to a token that may read it"
    );
    let push = Error::HubAuth {
        repo: "o/n".into(),
        file: "the commit".into(),
        status: 403,
        token_source: Some("`HF_TOKEN`".into()),
        write: true,
    };
    assert_eq!(
        push.to_string(),
        "`o/n`: the Hub answered 403 for `the commit`; the token from `HF_TOKEN` may not write to it (it needs write \
         access to the repository)"
    );
}

/// The typed variants say what the `reason` strings they replace said, word for word.
#[test]
fn typed_variants_keep_their_messages() {
    let cases = [
        (
            Error::DcpItemDtype {
                path: "d/__1_0.distcp".into(),
                tensor: "w".into(),
                rank: Some(1),
                at: 64,
                found: crate::Dtype::F64,
                expected: crate::Dtype::F32,
            },
            "d/__1_0.distcp (rank 1): tensor `w`: the item at byte 64 holds `F64` where the metadata says `F32`",
        ),
        (
            Error::MissingRngFile { path: "s/random_states_1.pkl".into(), rank: 1, world: 3 },
            "s/random_states_1.pkl: rank 1: missing: the folder was saved by 3 ranks and rank 1 left no RNG file",
        ),
        (
            Error::MissingMegatronRank { path: "m/mp_rank_01/model_optim_rng.pt".into(), rank: 1, tp: 2, pp: 1 },
            "m/mp_rank_01/model_optim_rng.pt (rank 1): missing: the save has 2 tensor-parallel × 1 pipeline ranks, \
             but this rank's file is not there",
        ),
        (
            Error::ZeroDtype {
                path: "t/zero_pp_rank_1_mp_rank_00_optim_states.pt".into(),
                rank: 1,
                tensor: "optimizer_state_dict.single_partition_of_fp32_groups.0".into(),
                found: crate::Dtype::F16,
                expected: crate::Dtype::F32,
            },
            "t/zero_pp_rank_1_mp_rank_00_optim_states.pt: rank 1, `optimizer_state_dict.single_partition_of_fp32_groups.0`: \
             dtype is `F16`, expected `F32`",
        ),
    ];
    for (e, want) in cases {
        assert_eq!(e.to_string(), want);
    }
}
