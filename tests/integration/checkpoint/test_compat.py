"""A checkpoint of an older layout (``tests/fixtures/old_checkpoint/step_00000002``, written by an older version
and kept unchanged) resumes through the command line and reproduces the uninterrupted run's step-4 losses
bitwise: those of the machine that wrote it, or of this machine where it has a recording of its own
(``other_machines``: another processor's kernels round otherwise, e.g. an AMD EPYC by 4e-8 relative); on a machine
with neither, within :data:`tests.golden_losses.OTHER_KERNELS_RTOL`, as the golden losses are compared."""

from __future__ import annotations

import json
import shutil

from tests.conftest import FIXTURES
from tests.golden_losses import OTHER_KERNELS_RTOL, machine_id
from tests.harness import cli
from tests.unit.checkpoint.test_reader import OLD


def test_old_checkpoint_resumes_bitwise(tmp_path):
    expected = json.loads((FIXTURES / "old_checkpoint" / "expected_step4.json").read_text())
    ckpt = shutil.copytree(OLD, tmp_path / "old" / OLD.name)
    cli(
        tmp_path,
        "resume",
        str(ckpt),
        "train.max_steps=4",
        f"checkpoint.dir={tmp_path / 'ckpt'}",
        f"data.cache_dir={tmp_path / 'cache'}",
        expect=0,
        timeout=600,
    )
    (final,) = (tmp_path / "ckpt").glob("*/step_00000004/manifest.json")
    metrics = json.loads(final.read_text())["metrics"]
    got = {k: metrics[k] for k in ("train/loss", "val/loss")}
    recordings = [expected, *expected.get("other_machines", {}).values()]
    if not any(all(got[k] == r[k] for k in got) for r in recordings):  # bitwise: a machine whose kernels it has
        assert expected.get("other_machines", {}).get(machine_id()) is None, (got, "this machine's own recording")
        print(f"\nno recording of this machine ({machine_id()}): within {OTHER_KERNELS_RTOL:g} relative")
        assert all(abs(got[k] / expected[k] - 1) <= OTHER_KERNELS_RTOL for k in got), (got, expected)
