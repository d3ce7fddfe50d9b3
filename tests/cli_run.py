"""`kdtree` in-process for the CLI tests: exit status, stdout, stderr."""

from __future__ import annotations

import pytest
import torch

from engine.cli import main


def run_main(args: list[str], capsys) -> tuple[int, str, str]:
    """The CLI in-process (it sets torch's CPU threads to 1: restored after)."""
    threads = torch.get_num_threads()
    try:
        with pytest.raises(SystemExit) as exit_info:
            main(args)
    finally:
        torch.set_num_threads(threads)
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err
