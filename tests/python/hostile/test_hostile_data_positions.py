"""`ShardedBatchSampler.resume_from_accelerate` on the hostile folders of
`fixtures/gen/hostile_accelerate_positions.py`: a `sampler.bin` that names `posix.system` or
`builtins.eval`, or saves epoch -1, is refused naming the file and the global or the value; the
sampler is left where it was, never moved to a sequential order at epoch 0."""

import pytest

from conftest import ROOT

HOSTILE = ROOT / "fixtures" / "hostile" / "accelerate_positions"
REFUSED = "outside what this kind of file may hold; the data position is not read, and none is guessed"


@pytest.mark.parametrize("name,reason", [
    ("sampler_system", f"its pickle names `posix.system`, {REFUSED}"),
    ("sampler_eval", f"its pickle names `builtins.eval`, {REFUSED}"),
    ("sampler_negative_epoch", "`state.epoch` is -1, not an epoch (a count from 0)"),
])
def test_a_position_file_that_cannot_be_read_is_refused_by_name(name, reason):
    from statekit.data import ShardedBatchSampler

    folder = HOSTILE / name
    s = ShardedBatchSampler(12, 4, num_processes=1, process_index=0, shuffle=True, seed=77)
    before = s.state_dict()
    for kwargs in [{}, {"step": 1, "epoch": 0}]:
        with pytest.raises(Exception) as e:
            s.resume_from_accelerate(folder, **kwargs)
        assert f"{folder / 'sampler.bin'}: {reason}" in str(e.value), str(e.value)
    assert s.epoch == 0 and s.state_dict() == before, "the sampler is where it was"
