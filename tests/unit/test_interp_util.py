"""The interpreter-check harness (tests/interp_util.py): checks shared between processes run once each, with the
inputs they get in a single process."""
from __future__ import annotations

import textwrap

from interp_util import run_interp_checks

SCRIPT = textwrap.dedent('''
    import os
    import sys

    import torch

    from interp_util import claimed

    marks = sys.argv[1]
    for name in claimed([f"c{i}" for i in range(7)]):
        try:
            open(os.path.join(marks, name), "x").close()
        except FileExistsError:  # a second run of a check: the harness fails on this exit code
            sys.exit(3)
        print(f"CHECK {name} ok {torch.rand(1).item():.6f}", flush=True)
''')


def test_shared_checks_run_once_each_with_their_single_process_inputs(tmp_path):
    script = tmp_path / "check.py"
    script.write_text(SCRIPT)
    (tmp_path / "one").mkdir()
    (tmp_path / "shared").mkdir()
    alone = run_interp_checks(script, (str(tmp_path / "one"),))
    shared = run_interp_checks(script, (str(tmp_path / "shared"),), shared=True)
    assert sorted(shared) == [f"c{i}" for i in range(7)]
    assert shared == alone  # the same draws: the generator is seeded from each check's name
    assert len(set(alone.values())) == 7
