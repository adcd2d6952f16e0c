//! Shard-layout math with no I/O: which rank owns which slice of which tensor.
//!
//! FSDP2 shards each parameter along dim 0 with `torch.chunk` rules: every rank gets
//! `ceil(n / world)` rows except the trailing ones, which get what is left, possibly nothing.

/// The half-open row range `[start, end)` of dim 0 that `rank` holds when a dimension of
/// `len` rows is chunked over `world` ranks the way `torch.chunk` (and FSDP2's `Shard(0)`) does.
///
/// Returns `None` when `world` is 0 or `rank >= world`.
pub fn chunk_rows(len: u64, world: u64, rank: u64) -> Option<std::ops::Range<u64>> {
    if world == 0 || rank >= world {
        return None;
    }
    let chunk = len.div_ceil(world);
    let start = (chunk * rank).min(len);
    let end = (start + chunk).min(len);
    Some(start..end)
}

#[cfg(test)]
mod tests {
    use super::chunk_rows;

    #[test]
    fn trailing_ranks_may_hold_nothing() {
        // torch.chunk(torch.arange(5), 4) gives sizes [2, 2, 1] and a fourth, empty, rank.
        let sizes: Vec<u64> = (0..4).map(|r| chunk_rows(5, 4, r).map(|x| x.end - x.start).unwrap_or(99)).collect();
        assert_eq!(sizes, vec![2, 2, 1, 0]);
    }

    #[test]
    fn every_row_is_owned_exactly_once() {
        for len in 0..40u64 {
            for world in 1..9u64 {
                let mut next = 0;
                for r in 0..world {
                    let range = chunk_rows(len, world, r).unwrap_or(0..0);
                    if range.is_empty() {
                        continue;
                    }
                    assert_eq!(range.start, next, "len {len} world {world} rank {r}");
                    next = range.end;
                }
                assert_eq!(next, len);
            }
        }
    }

    #[test]
    fn out_of_range_rank_is_none() {
        assert_eq!(chunk_rows(10, 2, 2), None);
        assert_eq!(chunk_rows(10, 0, 0), None);
    }
}
