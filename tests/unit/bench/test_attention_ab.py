"""bench.attention_ab: the kernels of two source directories, side by side."""
import re
import shutil
from pathlib import Path

import pytest

from bench import attention_ab
from services.worker import cpu_kernels

KERNELS = Path(cpu_kernels.__file__).parent / "kernels"


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_two_copies_of_the_kernels_time_the_same_outputs(tmp_path, capsys):
    copy = shutil.copytree(KERNELS, tmp_path / "kernels")
    attention_ab.main([str(KERNELS), str(copy), "--rows", "1,5", "--context", "40", "--reps", "2"])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["1 rows", "5 rows"]
    for line in lines:
        times = re.search(r": (\S+) (\S+) ms per step", line).groups()
        assert all(float(t) > 0 for t in times)
        assert line.endswith("largest difference from the first: 0 0")
