"""accelerate 1.15.0's own `tests/test_data_loader.py`, run against `statekit.accelerate`.

The file comes from accelerate's source distribution, which `.ci/setup` unpacks under the venv
(`$VENV/share/accelerate-1.15.0-src`); it is never copied into this repository. It is loaded
unedited, with the names it imports from `accelerate.data_loader` bound to ours while its
`from accelerate.data_loader import ...` runs (`accelerate.data_loader` is restored right after,
so nothing else sees them), and its `Accelerator` replaced by one that `statekit.accelerate.patch`
has patched:

- ours: `DataLoaderShard`, `DataLoaderDispatcher`, `BatchSamplerShard`, `IterableDatasetShard`,
  `prepare_data_loader`, `skip_first_batches`, and `Accelerator.prepare_data_loader`;
- accelerate's own, which statekit does not replace: `SeedableRandomSampler`,
  `SkipBatchSampler`, `SkipDataLoader`, `DataLoaderStateMixin`, `GradientState`.

Left out, each with its reason:

- `test_iterable_dataset_native_sharding_when_n_shards_equals_num_processes`: needs 🤗
  datasets (skipped by the file's own `require_datasets`; datasets is not installed).

Of the 37 tests the file gives, 36 pass and 1 is skipped. Of the 36, 25 run on statekit's
batches, the four `*_equivalent_to_torchdata_stateful_dataloader_*` among them: on one process,
a loader's `state_dict()` is key for key the one torchdata's `StatefulDataLoader` saves, and
loads back. Custom batch samplers (`SimpleBatchSampler`, lists of lists,
`DropLastBatchSampler`) run too: statekit does not model them, so they go through accelerate's
own code inside our classes (`test_batch_sampler_with_varying_batch_size`,
`test_batch_sampler_varying_batch_size_*` (2), `test_split_batches_validates_dynamic_batch_size`,
`test_set_epoch_in_batch_sampler`, `test_skip_first_batches_preserves_iteration`,
`test_skip_first_batches_does_not_reset_sampler_epoch`); `test_skip_batch_sampler` and the two
`test_skip_data_loader` test accelerate's own classes, and `test_skip_first_batches` skips on a
plain, unprepared `DataLoader`, which goes to accelerate's function.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

import accelerate
import accelerate.data_loader as accelerate_data_loader
import statekit.accelerate as ours

SRC = Path(os.environ.get("ACCELERATE_SRC", Path(sys.prefix) / "share" / "accelerate-1.15.0-src"))
TEST_FILE = SRC / "tests" / "test_data_loader.py"

REPLACED = ("DataLoaderShard", "DataLoaderDispatcher", "BatchSamplerShard", "IterableDatasetShard",
            "prepare_data_loader", "skip_first_batches")

class _PatchedAccelerator(accelerate.Accelerator):
    """accelerate's `Accelerator` with the one line a script adds."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        ours.patch(self)


def _load_accelerate_tests():
    if not TEST_FILE.is_file():
        pytest.fail(f"{TEST_FILE} is missing: .ci/setup unpacks accelerate 1.15.0's source distribution there",
                    pytrace=False)
    saved = {name: getattr(accelerate_data_loader, name) for name in REPLACED}
    try:
        for name in REPLACED:
            setattr(accelerate_data_loader, name, getattr(ours, name))
        spec = importlib.util.spec_from_file_location("accelerate_1_15_test_data_loader", TEST_FILE)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        for name, value in saved.items():
            setattr(accelerate_data_loader, name, value)
    module.Accelerator = _PatchedAccelerator
    for name in REPLACED:  # what the file's tests call is ours, not accelerate's
        assert getattr(module, name) is getattr(ours, name), name
    return module


_accelerate_tests = _load_accelerate_tests()
DataLoaderTester = _accelerate_tests.DataLoaderTester
StatefulDataLoaderTester = _accelerate_tests.StatefulDataLoaderTester
