//! One operation over the ranks of an MPI job (`mpirun -np N ckpt …`, the `mpi` feature): the
//! output is byte for byte one process's (`mpi`), and one rank failing alone at any phase of the
//! protocol fails the whole job the same way on every rank (`faults`).

#[path = "../common/mod.rs"]
mod common;

mod faults;
mod mpi;
