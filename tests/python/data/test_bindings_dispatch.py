"""statekit.data.prepare_data_loader(dispatch_batches=True) against accelerate 1.15's
DataLoaderDispatcher, in a real torchrun job (gloo, CPU, 2 ranks): the same batches on every
rank, over two epochs and several configurations, and a mid-epoch resume that yields exactly
the rest."""

import json
from pathlib import Path

import pytest
from torch.utils.data import DataLoader

from conftest import torchrun
from statekit.data import DataLoaderConfiguration, prepare_data_loader
from statekit.errors import StateMismatch

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("dispatch")
    proc = torchrun(2, HERE / "bindings_dispatch_job.py", out)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def tiny_job(tmp_path_factory):
    """3 ranks over datasets smaller than a global batch: some rank's slice of the last batch is
    empty."""
    out = tmp_path_factory.mktemp("dispatch_tiny")
    proc = torchrun(3, HERE / "bindings_dispatch_job.py", out, "tiny")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(3)]


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_a_rank_whose_slice_is_empty_gets_an_empty_batch_as_in_accelerate(tiny_job, rank):
    for r in tiny_job[rank]:
        assert r["got"] == r["expected"], r["config"]
        assert r["head"] + r["tail"] == r["expected"][0], r["config"]
    # The first case (1 sample, 3 ranks): rank 2's one batch is empty.
    assert tiny_job[2][0]["expected"] == [[[]], [[]]]


@pytest.mark.parametrize("rank", [0, 1])
def test_dispatched_batches_equal_accelerates_on_every_rank(job, rank):
    for r in job[rank]:
        assert r["got"] == r["expected"], r["config"]
        assert r["len_ours"] == len(r["expected"][0]), r["config"]


@pytest.mark.parametrize("rank", [0, 1])
def test_dispatched_loader_resumes_mid_epoch(job, rank):
    for r in job[rank]:
        assert r["head"] + r["tail"] == r["expected"][0], r["config"]


def test_dispatch_without_a_process_group_is_rank_zeros_slices():
    dl = DataLoader(range(11), batch_size=3)
    cfg = DataLoaderConfiguration(dispatch_batches=True)
    got = [[b.tolist() for b in prepare_data_loader(dl, num_processes=2, process_index=p, dataloader_config=cfg)] for p in range(2)]
    # Two underlying batches per step, cut in two; the last (rows 9, 10) padded with row 0.
    assert got == [[[0, 1, 2], [6, 7, 8]], [[3, 4, 5], [9, 10, 0]]]


def test_a_dispatched_state_does_not_load_into_a_per_rank_loader():
    dl = DataLoader(range(11), batch_size=3)
    dispatched = prepare_data_loader(dl, num_processes=2, process_index=0, dataloader_config=DataLoaderConfiguration(dispatch_batches=True))
    per_rank = prepare_data_loader(dl, num_processes=2, process_index=0)
    with pytest.raises(StateMismatch):
        per_rank.batch_sampler.load_state_dict(dispatched.batch_sampler.state_dict())
