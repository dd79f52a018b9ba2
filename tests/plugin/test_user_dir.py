"""``python -m fairseq_linattn --user-dir`` prints the path fairseq's ``--user-dir`` loads the plugin from, whatever
the current directory (the README's train commands use it)."""
import os

import pytest
from helpers import ROOT

from fairseq_linattn.__main__ import main


def test_user_dir_is_the_plugin_package_whatever_the_current_directory(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["--user-dir"]) == 0
    printed = capsys.readouterr().out
    assert printed.endswith("\n") and printed.count("\n") == 1  # one line, for "$(...)"
    path = printed.strip()
    assert os.path.isabs(path) and os.path.samefile(path, ROOT / "fairseq_linattn")
    assert os.path.isfile(os.path.join(path, "__init__.py")) and os.path.isdir(os.path.join(path, "models"))


def test_without_an_option_it_prints_its_usage_and_exits_2(capsys):
    assert main([]) == 2
    assert "--user-dir" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--no-such-option"])
