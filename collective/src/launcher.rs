//! Whether a launcher started this process as one rank of several, from the variables it sets:
//! what a program that cannot talk to the other ranks (a `ckpt` built without MPI) checks, so
//! that it refuses instead of running the whole job once per rank.

/// Variables that give the number of ranks a launcher started, and who sets them.
const SIZES: [&str; 4] = [
    // Open MPI's `mpirun`/`mpiexec` (also Open MPI 5's `prterun`).
    "OMPI_COMM_WORLD_SIZE",
    // PMI-1/PMI-2 launchers: MPICH's and Intel MPI's Hydra, Slurm's `srun --mpi=pmi2`.
    "PMI_SIZE",
    // MVAPICH2's `mpirun_rsh`.
    "MV2_COMM_WORLD_SIZE",
    // Slurm's `srun`: the tasks of its job step. Not `SLURM_NTASKS`, which an `sbatch` script
    // also has while it runs as one process; a batch script has no `SLURM_STEP_*` variable.
    "SLURM_STEP_NUM_TASKS",
];

/// Variables that give this process's rank. PMIx launchers export no size (a PMIx client asks
/// its server), so a rank above 0 is how a PMIx rank knows it is not alone; rank 0 cannot tell.
const RANKS: [&str; 4] = ["PMIX_RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"];

/// A launcher's word that this process is one of several ranks: the variable that says so, its
/// value, and how many ranks that makes at least.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Launched {
    /// The variable (`OMPI_COMM_WORLD_SIZE`, `PMIX_RANK`, …).
    pub var: &'static str,
    /// Its value, as set.
    pub value: String,
    /// The number of ranks it implies: the size it gives, or one more than the rank it gives.
    pub ranks: u64,
}

impl std::fmt::Display for Launched {
    /// `2 ranks (`OMPI_COMM_WORLD_SIZE=2`)`, or `at least 2 ranks (`PMIX_RANK=1`)` for a rank.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let at_least = if SIZES.contains(&self.var) { "" } else { "at least " };
        write!(f, "{at_least}{} ranks (`{}={}`)", self.ranks, self.var, self.value)
    }
}

/// The launcher's word that this process is one of several ranks, if a launcher started it so.
pub fn launched_ranks() -> Option<Launched> {
    launched_ranks_in(|var| std::env::var(var).ok())
}

/// [`launched_ranks`] over the variables `env` gives.
fn launched_ranks_in(env: impl Fn(&str) -> Option<String>) -> Option<Launched> {
    let number = |var: &str| env(var).and_then(|v| Some((v.trim().parse::<u64>().ok()?, v)));
    let size = SIZES.iter().find_map(|&var| number(var).filter(|(n, _)| *n > 1).map(|(n, v)| (var, v, n)));
    let rank = || RANKS.iter().find_map(|&var| number(var).filter(|(n, _)| *n > 0).map(|(n, v)| (var, v, n + 1)));
    size.or_else(rank).map(|(var, value, ranks)| Launched { var, value, ranks })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn from(vars: &[(&str, &str)]) -> Option<Launched> {
        launched_ranks_in(|v| vars.iter().find(|(k, _)| *k == v).map(|(_, x)| x.to_string()))
    }

    #[test]
    fn launchers_of_several_ranks_are_recognised_by_their_variables() {
        let two = from(&[("OMPI_COMM_WORLD_SIZE", "2"), ("OMPI_COMM_WORLD_RANK", "0")]).unwrap();
        assert_eq!(two.to_string(), "2 ranks (`OMPI_COMM_WORLD_SIZE=2`)");
        assert_eq!(from(&[("PMI_SIZE", "4"), ("PMI_RANK", "0")]).unwrap().ranks, 4);
        assert_eq!(from(&[("SLURM_STEP_NUM_TASKS", "8"), ("SLURM_PROCID", "0")]).unwrap().var, "SLURM_STEP_NUM_TASKS");
        assert_eq!(from(&[("MV2_COMM_WORLD_SIZE", "3")]).unwrap().ranks, 3);
        // PMIx gives a rank only: one above 0 is not alone.
        let pmix = from(&[("PMIX_RANK", "1"), ("PMIX_NAMESPACE", "job")]).unwrap();
        assert_eq!(pmix.to_string(), "at least 2 ranks (`PMIX_RANK=1`)");
    }

    #[test]
    fn one_rank_or_a_batch_script_is_not_a_job_of_several() {
        assert_eq!(from(&[]), None);
        assert_eq!(from(&[("OMPI_COMM_WORLD_SIZE", "1"), ("OMPI_COMM_WORLD_RANK", "0")]), None);
        assert_eq!(from(&[("PMIX_RANK", "0")]), None);
        // An `sbatch` script for 4 tasks runs once, before any `srun`.
        assert_eq!(from(&[("SLURM_NTASKS", "4"), ("SLURM_PROCID", "0"), ("SLURM_JOB_ID", "7")]), None);
        assert_eq!(from(&[("PMI_SIZE", "two")]), None, "a value that is no number says nothing");
    }
}
