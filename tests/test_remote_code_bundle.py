"""hf_hybrid/remote_code.py parses each module file once per version of the file: a second bundle
of the same architecture reads nothing again and gives the same files; a changed file (another
mtime / size) is read again."""
import os
from types import SimpleNamespace

from hf_hybrid import remote_code

ENTRY_POINTS = {"hf_hybrid.models.rat.configuration_rat": "configuration_rat",
                "hf_hybrid.models.rat.modeling_rat": "modeling_rat"}


def test_a_second_bundle_parses_nothing_again_and_is_identical():
    first = remote_code.bundle_modules(ENTRY_POINTS)
    before = remote_code._parsed_source.cache_info()
    second = remote_code.bundle_modules(ENTRY_POINTS)
    after = remote_code._parsed_source.cache_info()
    assert second == first and "modeling_rat.py" in first and "configuration_rat.py" in first
    assert after.misses == before.misses and after.hits - before.hits == len(first)


def test_a_changed_file_is_parsed_again(monkeypatch):
    remote_code.bundle_modules(ENTRY_POINTS)
    misses = remote_code._parsed_source.cache_info().misses
    real_stat = os.stat

    def newer(path, *args, **kwargs):
        result = real_stat(path, *args, **kwargs)
        if str(path).endswith("modeling_rat.py"):  # the file as if saved again, one second later
            return SimpleNamespace(st_mtime_ns=result.st_mtime_ns + 10**9, st_size=result.st_size)
        return result

    monkeypatch.setattr(remote_code.os, "stat", newer)
    remote_code.bundle_modules(ENTRY_POINTS)
    assert remote_code._parsed_source.cache_info().misses == misses + 1
