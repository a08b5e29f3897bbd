"""The operator image has no torch: the operator must never import it or the engine."""

import os
import subprocess
import sys


def test_operator_entry_module_imports_neither_torch_nor_the_engine(tmp_path):
    code = (
        "import sys, moemesh.operator.main\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'moemesh.engine')))\n"
        "assert not bad, bad\n"
    )
    # run outside the repository root, where the operator/ folder would shadow the stdlib `operator`
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=dict(os.environ), capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
