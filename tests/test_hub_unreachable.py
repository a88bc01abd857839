"""A Hub that cannot be reached ends in one line that names the fix, never in the HTTP client's
traceback: the push_to_hub example exits 1 with that line, model.push_to_hub raises
HubUnreachableError carrying it. Nothing leaves the machine: the endpoint is a closed loopback port."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub.errors import OfflineModeIsEnabled

from hf_hybrid.hub import HubUnreachableError, reaching_the_hub, unreachable_message

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "push_to_hub.py"
CLOSED_PORT = "http://127.0.0.1:9"  # the discard port: nothing listens on loopback


def client_env(tmp_path: Path, **settings: str) -> dict[str, str]:
    """This environment without Hub settings or tokens, an empty HF_HOME, plus ``settings``."""
    hub_settings = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_OFFLINE", "TRANSFORMERS_CACHE")
    env = {k: v for k, v in os.environ.items() if not k.startswith(hub_settings) or k.startswith("HF_HYBRID_")}
    env.update(HF_HOME=str(tmp_path / "hf_home"), HF_HUB_DISABLE_TELEMETRY="1", NO_PROXY="127.0.0.1,localhost",
               OMP_NUM_THREADS="1", **settings)
    return env


def run(argv: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], env=env, cwd=cwd, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("setting, expected", [
    ({"HF_ENDPOINT": CLOSED_PORT}, f"cannot reach the Hugging Face Hub at {CLOSED_PORT}"),
    ({"HF_HUB_OFFLINE": "1"}, "HF_HUB_OFFLINE"),
])
def test_example_ends_in_one_line_with_the_fix(tmp_path, setting, expected):
    result = run([str(EXAMPLE), "--repo-id", "me/tiny-rat", "--token", "hf_test"], client_env(tmp_path, **setting), tmp_path)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("push_to_hub.py: ") and expected in last, last


def test_model_push_to_hub_raises_a_one_line_error(tmp_path):
    script = (
        "import hf_hybrid\n"
        "from hf_hybrid.hub import HubUnreachableError\n"
        "model = hf_hybrid.RatForCausalLM(hf_hybrid.RatConfig(vocab_size=32, hidden_size=16, intermediate_size=32,\n"
        "    num_hidden_layers=1, num_attention_heads=2, chunk_size=4))\n"
        "try:\n"
        "    model.push_to_hub('me/tiny-rat', token='hf_test')\n"
        "except HubUnreachableError as error:\n"
        "    print('UNREACHABLE', error)\n"
    )
    result = run(["-c", script], client_env(tmp_path, HF_ENDPOINT=CLOSED_PORT), tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("UNREACHABLE ")]
    assert f"cannot reach the Hugging Face Hub at {CLOSED_PORT}" in line and "HF_ENDPOINT" in line
    assert "save_pretrained" in line


def _chained(outer: Exception, cause: BaseException) -> Exception:
    outer.__cause__ = cause
    return outer


def test_only_connection_failures_are_translated():
    refused = _chained(RuntimeError("transport failed"), ConnectionRefusedError(111, "Connection refused"))
    assert "Connection refused" in unreachable_message(refused, "http://hub.example")
    assert "HF_HUB_OFFLINE" in unreachable_message(OfflineModeIsEnabled("offline"))
    assert unreachable_message(ValueError("bad repo id")) is None
    assert unreachable_message(_chained(RuntimeError("x"), FileNotFoundError("no such file"))) is None

    with pytest.raises(HubUnreachableError, match="cannot reach the Hugging Face Hub at http://hub.example") as info:
        with reaching_the_hub("http://hub.example"):
            raise refused
    assert info.value.__cause__ is refused and "\n" not in str(info.value)
    with pytest.raises(ValueError, match="bad repo id"):
        with reaching_the_hub():
            raise ValueError("bad repo id")
