"""No user-facing string shows a Python placeholder literally: a plain string literal that sits next to
an f-string (implicit concatenation) and contains ``{name}`` almost always lost its ``f`` prefix."""
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted(p for folder in ("hf_hybrid", "kernels", "conversion", "examples") for p in (ROOT / folder).rglob("*.py"))
PLACEHOLDER = re.compile(r"(?<!\{)\{[A-Za-z_][A-Za-z0-9_]*(\[[^\]]*\]|\.[A-Za-z_]\w*)*(![rsa])?(:[^}]*)?\}(?!\})")


def _prefix(token: tokenize.TokenInfo) -> str:
    return re.match(r"[A-Za-z]*", token.string).group(0).lower()


def missing_f_prefixes(source: str) -> list[int]:
    """Line numbers of plain string literals with a placeholder, concatenated with an f-string."""
    tokens = [t for t in tokenize.generate_tokens(io.StringIO(source).readline)
              if t.type not in (tokenize.NL, tokenize.COMMENT)]
    found = []
    for i, token in enumerate(tokens):
        if token.type != tokenize.STRING or "f" in _prefix(token) or not PLACEHOLDER.search(token.string):
            continue
        neighbours = tokens[max(i - 1, 0) : i] + tokens[i + 1 : i + 2]
        if any(n.type == tokenize.STRING and "f" in _prefix(n) for n in neighbours):
            found.append(token.start[0])
    return found


def test_the_check_finds_a_lost_f_prefix():
    assert missing_f_prefixes('x = (f"a {b} " "c {d}")\n') == [1]
    assert missing_f_prefixes('x = (f"a {b} " "c {{d}}")\ny = "{d}".format(d=1)\n') == []


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_placeholder_lost_its_f_prefix(path):
    assert missing_f_prefixes(path.read_text(encoding="utf-8")) == []
