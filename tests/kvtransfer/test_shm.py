"""Shared tensors: another process writes in place; attachers never unlink; views outlive close."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdserve.kvtransfer.shm import NAME_PREFIX, SharedTensor

REPO = Path(__file__).resolve().parents[2]


def test_other_process_writes_in_place_and_its_exit_does_not_unlink():
    with SharedTensor.create((3, 4), torch.float32) as owner:
        assert owner.name.startswith(NAME_PREFIX) and len(owner.name) >= len(NAME_PREFIX) + 32
        assert bool((owner.tensor == 0).all())
        code = (
            "import torch\nfrom kvtransfer.shm import SharedTensor\n"
            f"a = SharedTensor.attach({owner.name!r}, (3, 4), torch.float32)\n"
            "a.tensor[1] = torch.arange(4.0)\na.close()\n"
        )
        r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert "leaked" not in r.stderr and "resource_tracker" not in r.stderr
        assert owner.tensor[1].tolist() == [0.0, 1.0, 2.0, 3.0]
        # the attacher exited: the segment is still ours and still attachable
        again = SharedTensor.attach(owner.name, (3, 4), torch.float32)
        assert again.tensor[1, 3].item() == 3.0
        again.close()
        assert os.path.exists(f"/dev/shm/{owner.name}") or sys.platform != "linux"
    assert not os.path.exists(f"/dev/shm/{owner.name}")  # the owner unlinked it
    with pytest.raises(FileNotFoundError):
        SharedTensor.attach(owner.name, (3, 4), torch.float32)


def test_attach_checks_size_and_name():
    with SharedTensor.create((2, 2), torch.float32) as owner:
        with pytest.raises(ValueError, match="needs"):
            SharedTensor.attach(owner.name, (4, 4), torch.float32)
        with pytest.raises(ValueError):
            SharedTensor.attach("../etc/passwd", (1,), torch.float32)
        b = SharedTensor.attach(owner.name, (2, 2), torch.bfloat16)  # smaller view is allowed
        b.close()


def test_views_outlive_close_without_dangling():
    owner = SharedTensor.create((2, 8), torch.float32)
    view = owner.tensor[1]
    owner.close()
    owner.close()  # idempotent
    view.fill_(2.0)  # the mapping stays until the last view is gone
    assert view.sum().item() == 16.0
