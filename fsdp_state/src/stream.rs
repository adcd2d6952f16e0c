//! A data stream's position counted in global batches: what one step of `world` ranks
//! consumes of the global order, and how a count of steps reads on another world size.
//!
//! `dataload` counts its cursor with these (a position is the number of samples of the
//! epoch's global order the world has consumed), and `ckpt` moves an accelerate folder's
//! dataloader state to another world size with them, so that the two never keep their own
//! copies of the rule while neither imports the other. Pure arithmetic, no I/O; products are
//! taken in 128 bits and saturate at `u64::MAX`, so a forged count cannot wrap.

/// Samples of the global order one step consumes: the batch size when each batch is split
/// across the ranks (accelerate's `split_batches`), else one batch per rank.
pub fn global_batch(batch_size: u64, world_size: u64, split_batches: bool) -> u64 {
    if split_batches {
        batch_size
    } else {
        batch_size.saturating_mul(world_size)
    }
}

/// The cursor once `steps` steps of `global_batch` samples were consumed from `start`
/// (saturating; a caller caps it at the epoch's length).
pub fn cursor_after(start: u64, steps: u64, global_batch: u64) -> u64 {
    start.saturating_add(steps.saturating_mul(global_batch))
}

/// The whole steps of `global_batch` samples that fit before `cursor` (0 when a step consumes
/// nothing).
pub fn steps_before(cursor: u64, global_batch: u64) -> u64 {
    cursor.checked_div(global_batch).unwrap_or(0)
}

/// `steps` steps of a world of `from` ranks, read as whole steps of a world of `to` ranks
/// (each rank reading `per_rank` samples a step on both, no `split_batches`): the cursor the
/// old world reached, cut in the new world's global batches, rounded down. A step the new
/// world can only partly fill is read again, as accelerate's `BatchSamplerShard` deals whole
/// rounds.
pub fn steps_on_world(steps: u64, per_rank: u64, from: u64, to: u64) -> u64 {
    let cursor = u128::from(steps) * u128::from(per_rank) * u128::from(from);
    let step = u128::from(per_rank) * u128::from(to);
    cursor.checked_div(step).map_or(0, |s| u64::try_from(s).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_is_one_batch_per_rank_or_one_split_batch() {
        assert_eq!(global_batch(4, 3, false), 12);
        assert_eq!(global_batch(4, 3, true), 4);
        assert_eq!(global_batch(u64::MAX, 2, false), u64::MAX);
    }

    #[test]
    fn cursors_and_steps_are_inverse_on_whole_steps() {
        for g in 1..7 {
            for k in 0..20 {
                assert_eq!(steps_before(cursor_after(0, k, g), g), k);
                assert_eq!(steps_before(cursor_after(0, k, g) + g - 1, g), k);
            }
        }
        assert_eq!(steps_before(10, 0), 0);
        assert_eq!(cursor_after(5, u64::MAX, 2), u64::MAX);
    }

    /// (steps, per-rank batch, from, to) → steps on the new world.
    #[test]
    fn steps_move_between_world_sizes_rounding_down() {
        let cases = [
            (10, 1, 2, 2, 10),
            (10, 1, 2, 4, 5),
            (3, 1, 2, 4, 1), // 6 batches read: one whole round of 4, the other 2 read again
            (3, 8, 4, 2, 6),
            (7, 2, 3, 2, 10),
            (0, 4, 3, 5, 0),
            (5, 0, 2, 3, 0),
            (u64::MAX, 1, 4, 1, u64::MAX),
        ];
        for (steps, per_rank, from, to, want) in cases {
            assert_eq!(steps_on_world(steps, per_rank, from, to), want, "{steps} {per_rank} {from}->{to}");
        }
    }
}
