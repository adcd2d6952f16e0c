//! Which elements of the flat parameter vector (parameter after parameter, each row-major) a
//! rank owns: FSDP2's dim-0 chunks of every parameter, as [`ParamMeta::chunk`] computes them.

use std::ops::Range;

use crate::state::ParamMeta;

/// The ranks' shares of the flat parameter vector.
#[derive(Debug, Clone)]
pub(crate) struct Shards {
    params: Vec<ParamMeta>,
    world: u64,
    /// Global element offset of each parameter.
    offsets: Vec<usize>,
    /// Per rank: its element count.
    lens: Vec<usize>,
    /// The longest rank segment (collectives move equal blocks).
    max: usize,
}

impl Shards {
    pub(crate) fn new(params: Vec<ParamMeta>, world: u64) -> Shards {
        let lens: Vec<usize> = (0..world)
            .map(|r| {
                params.iter().map(|p| (p.chunk(world, r).end - p.chunk(world, r).start) as usize * p.row_len()).sum()
            })
            .collect();
        let max = lens.iter().copied().max().unwrap_or(0);
        let offsets = params.iter().scan(0, |acc, p| Some(std::mem::replace(acc, *acc + p.numel()))).collect();
        Shards { params, world, offsets, lens, max }
    }

    /// The parameters, in order.
    pub(crate) fn params(&self) -> &[ParamMeta] {
        &self.params
    }

    /// Rank `r`'s element count.
    pub(crate) fn len(&self, r: u64) -> usize {
        self.lens[r as usize]
    }

    /// The longest rank segment.
    pub(crate) fn max(&self) -> usize {
        self.max
    }

    /// Rank `r`'s element ranges of the flat parameter vector, one per parameter, in order.
    pub(crate) fn ranges(&self, r: u64) -> Vec<Range<usize>> {
        self.params
            .iter()
            .zip(&self.offsets)
            .map(|(p, &off)| {
                let rows = p.chunk(self.world, r);
                off + rows.start as usize * p.row_len()..off + rows.end as usize * p.row_len()
            })
            .collect()
    }

    /// Rank `r`'s ranges within its own segment (its chunks back to back), one per parameter.
    pub(crate) fn local_ranges(&self, r: u64) -> Vec<Range<usize>> {
        let mut at = 0;
        self.ranges(r)
            .into_iter()
            .map(|g| {
                let local = at..at + g.len();
                at = local.end;
                local
            })
            .collect()
    }

    /// Copies rank `r`'s elements of `full` into the start of `out` (in parameter order) and
    /// zeroes the rest of it.
    pub(crate) fn cut_into(&self, full: &[f32], r: u64, out: &mut [f32]) {
        let mut at = 0;
        for range in self.ranges(r) {
            let n = range.len();
            out[at..at + n].copy_from_slice(&full[range]);
            at += n;
        }
        out[at..].fill(0.0);
    }

    /// Places rank `r`'s segment `seg` into `full`.
    pub(crate) fn place(&self, seg: &[f32], r: u64, full: &mut [f32]) {
        let mut at = 0;
        for range in self.ranges(r) {
            let n = range.len();
            full[range].copy_from_slice(&seg[at..at + n]);
            at += n;
        }
    }
}
