"""The DataLoader worker settings the torchrun jobs share."""


def workers(n):
    """`n` worker processes, started from a forkserver. Forked straight from the job's process
    (torch's default), a worker can hang in CPython 3.11's after-fork clean-up when the fork lands
    while another thread of the job is exiting, such as the queue feeder thread of the loader
    iterated just before; the forkserver is single-threaded. The jobs build both sides' loaders
    with it, so batches and generator states do not depend on it."""
    return dict(num_workers=n, multiprocessing_context="forkserver") if n else dict(num_workers=0)
