"""verl.utils.import_utils: files, pkg:// modules, missing paths, external libs."""

import sys

import pytest

from verl.utils.import_utils import import_external_libs, load_extern_object, load_extern_type, load_module


def test_load_from_a_file_and_file_prefix(tmp_path):
    source = tmp_path / "plugin.py"
    source.write_text("VALUE = 41\nclass Thing:\n    pass\ndef fn():\n    return VALUE + 1\n")
    assert load_extern_object(str(source), "fn")() == 42
    assert load_extern_object(f"file://{source}", "VALUE") == 41
    assert load_extern_type(str(source), "Thing").__name__ == "Thing"
    with pytest.raises(AttributeError, match="defines these callables: \\['Thing', 'fn'\\]"):
        load_extern_object(str(source), "missing")


def test_pkg_prefix_imports_an_installed_module():
    module = load_module("pkg://verl/utils/metric")
    assert module is sys.modules["verl.utils.metric"]
    assert load_extern_object("pkg://verl.utils.metric", "Metric").__name__ == "Metric"


def test_no_path_means_nothing_to_load():
    assert load_module(None) is None and load_module("") is None
    assert load_extern_type(None, "Anything") is None
    with pytest.raises(AttributeError, match="path is not set"):
        load_extern_object(None, "SomeType")


def test_import_external_libs(tmp_path, monkeypatch):
    (tmp_path / "verl_test_side_effect.py").write_text("import builtins\nbuiltins._verl_side_effect = 7\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import_external_libs("verl_test_side_effect")
    import builtins

    assert builtins._verl_side_effect == 7
    del builtins._verl_side_effect
    import_external_libs(None)
