"""Servers the comparison starts must not see the repository's top-level folders as packages."""

import subprocess
import sys
from pathlib import Path

from pdserve.bench.servers import ServerSpec, child_env

REPO = Path(__file__).resolve().parents[2]


def test_server_started_from_repo_root_does_not_import_its_kernels_folder():
    assert (REPO / "kernels" / "__init__.py").exists()
    probe = "import importlib.util as u; s = u.find_spec('kernels'); print(s.origin if s else None)"
    spec = ServerSpec("probe", [sys.executable, "-c", probe])
    seen = subprocess.run(spec.argv, cwd=REPO, env=child_env(spec), capture_output=True, text=True, check=True)
    assert str(REPO / "kernels") not in seen.stdout
    # the same probe without the guard does find it: the test can fail
    bare = subprocess.run(spec.argv, cwd=REPO, capture_output=True, text=True, check=True, env={"PATH": ""})
    assert str(REPO / "kernels") in bare.stdout
