"""Children die with their parent, even one killed with SIGKILL (relay_engine.core.lifetime)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _gone(pid: int) -> bool:
    """No such process, or only its zombie (dead, waiting for init to reap it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def _wait_gone(pid: int, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not _gone(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _parent_printing_its_childs_pid(body: str) -> tuple[subprocess.Popen, int]:
    """A Python parent that starts a child as ``body`` says, prints the child's pid, then sleeps."""
    script = textwrap.dedent(body) + "\nprint(child_pid, flush=True)\nimport time\ntime.sleep(600)\n"
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True)
    line = parent.stdout.readline()
    assert line.strip().isdigit(), f"the parent printed {line!r}"
    return parent, int(line)


CHILDREN = {
    "a child started with die_with_parent": """
        import subprocess
        from relay_engine.core.lifetime import die_with_parent
        child_pid = subprocess.Popen(["sleep", "600"], preexec_fn=die_with_parent()).pid
    """,
    "the embedded redis-server": """
        from workers.embedded_redis import EmbeddedRedis
        child_pid = EmbeddedRedis(WORKDIR).start().process.pid
    """,
}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("which", list(CHILDREN))
def test_a_child_dies_when_its_parent_is_killed(which, tmp_path):
    parent, child = _parent_printing_its_childs_pid(f"WORKDIR = {str(tmp_path)!r}\n" + textwrap.dedent(CHILDREN[which]))
    try:
        assert not _gone(child)
        parent.kill()
        parent.wait(10)
        assert _wait_gone(child), f"{which} ({child}) outlived its SIGKILLed parent"
    finally:
        parent.kill()
        if not _gone(child):
            os.kill(child, signal.SIGKILL)


def test_the_embedded_redis_is_outside_its_owners_process_group(tmp_path):
    """A Ctrl-C to the stack's process group must not stop Redis before the instances leave the live
    set through it: the owner stops it last."""
    from workers.embedded_redis import EmbeddedRedis

    with EmbeddedRedis(tmp_path) as server:
        assert os.getpgid(server.process.pid) != os.getpgid(os.getpid())
