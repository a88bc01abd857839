"""Python processes kept for the test session, for checks that cannot run in the test process.

An sm_90 compile needs TRITON_INTERPRET unset; a remote-code load needs a process where hf_hybrid
cannot be imported. Starting an interpreter per check costs 10-20 s of imports (torch,
transformers, hf_hybrid) on the 2-core CI runner; a helper process pays them once per pytest
worker and then runs each check's snippet in a namespace of its own.

Usage::

    helper = shared_helper("sm90", dict(os.environ, TRITON_INTERPRET="0"))
    printed = helper.run("print(1 + 1)")  # raises HelperError with the snippet's traceback
"""
from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
import textwrap

# Reads one JSON request per line ({"code", "argv"}), answers one JSON line per request.
_SERVE = textwrap.dedent(
    """
    import contextlib, io, json, os, sys, traceback

    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever else reaches stdout (compilers, libraries) goes to the log, not the replies
    while True:
        line = sys.stdin.readline()
        if not line:
            break  # the test process closed the pipe (or died)
        request = json.loads(line)
        sys.argv[:] = ["-c", *request["argv"]]
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed):
                exec(compile(request["code"], "<snippet>", "exec"), {"__name__": "__main__"})
            reply = {"printed": printed.getvalue()}
        except BaseException:
            reply = {"printed": printed.getvalue(), "error": traceback.format_exc()}
        replies.write(json.dumps(reply) + "\\n")
        replies.flush()
    """
)


class HelperError(AssertionError):
    """A snippet raised (its traceback is the message), or the helper process died or hung."""


class HelperProcess:
    """A Python child that runs snippets with ``sys.argv[1:] = argv`` and returns what they print.

    It starts in a scratch folder of its own; ``prelude`` runs once, before any snippet.
    """

    def __init__(self, env: dict[str, str], prelude: str = ""):
        self.scratch = tempfile.TemporaryDirectory(prefix="hf-hybrid-helper-")
        self._log = tempfile.TemporaryFile("w+", errors="replace")  # the child's stderr (and stray stdout)
        self._process = subprocess.Popen(
            [sys.executable, "-c", _SERVE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
            env=env, cwd=self.scratch.name, text=True,
        )
        if prelude:
            self.run(prelude)

    @property
    def alive(self) -> bool:
        return self._process.poll() is None

    def run(self, code: str, *argv: str, timeout: float = 600) -> str:
        """Runs ``code`` in a fresh namespace; returns what it printed. A failed snippet closes the
        helper (it may have left modules half-imported), so the next check gets a new one."""
        try:
            self._process.stdin.write(json.dumps({"code": code, "argv": [str(a) for a in argv]}) + "\n")
            self._process.stdin.flush()
        except BrokenPipeError:
            pass  # the helper died: reported below
        ready, _, _ = select.select([self._process.stdout], [], [], timeout)
        line = self._process.stdout.readline() if ready else ""
        reply = json.loads(line) if line else {"error": "the helper process died" if ready else f"no answer in {timeout} s"}
        if "error" in reply:
            message = f"{reply['error']}\n--- helper log (tail) ---\n{self.log_tail()}"
            self.close()
            raise HelperError(message)
        return reply["printed"]

    def log_tail(self, chars: int = 3000) -> str:
        self._log.flush()
        self._log.seek(0)
        return self._log.read()[-chars:]

    def close(self) -> None:
        """Stops the process at once: every answer it gave was read already, nothing is left to flush."""
        self._process.kill()
        self._process.wait()
        for pipe in (self._process.stdin, self._process.stdout):
            try:
                pipe.close()
            except BrokenPipeError:
                pass
        self._log.close()
        self.scratch.cleanup()


_HELPERS: dict[str, HelperProcess] = {}


def shared_helper(name: str, env: dict[str, str], prelude: str = "") -> HelperProcess:
    """The session's helper called ``name``, started on first use (and again after it closed)."""
    helper = _HELPERS.get(name)
    if helper is None or not helper.alive:
        helper = _HELPERS[name] = HelperProcess(env, prelude)
    return helper


def close_helpers() -> None:
    while _HELPERS:
        _HELPERS.popitem()[1].close()


# Installed first in remote_code_helper: any import of hf_hybrid fails there.
BLOCK_HF_HYBRID = textwrap.dedent(
    """
    import sys

    class BlockHfHybrid:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "hf_hybrid":
                raise ModuleNotFoundError(f"No module named {name!r}")

    sys.meta_path.insert(0, BlockHfHybrid())
    """
)

# Offline, with the remote-code module cache in the helper's scratch folder (set before transformers
# is imported, which reads it once).
_LOADER_PRELUDE = 'import os\nos.environ["HF_MODULES_CACHE"] = os.path.abspath("modules")\n'


def _loader_env() -> dict[str, str]:
    return dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")


def hf_hybrid_helper() -> HelperProcess:
    """A process with hf_hybrid imported, for loading checkpoints with its own classes."""
    return shared_helper("hf_hybrid", _loader_env(), _LOADER_PRELUDE + "import hf_hybrid\n")


def remote_code_helper() -> HelperProcess:
    """A process where hf_hybrid cannot be imported: only code saved with a checkpoint runs there."""
    return shared_helper("remote_code", _loader_env(), _LOADER_PRELUDE + BLOCK_HF_HYBRID)
