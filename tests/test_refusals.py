"""tests/refusals.py, which `make refusals` runs: the refusals it finds, and its verdict."""

import json
import textwrap

import coverage

from tests import refusals

SOURCE = textwrap.dedent('''\
    import sys

    from errors import ConfigError


    class Unreadable(ConfigError):
        pass


    def check(value):
        if value < 0:
            raise ConfigError(f"value must be >= 0. Received: {value}")
        if value == 0:
            raise Unreadable("nothing to read")
        if value > 9:
            raise ConfigError.of(["too large", "and odd"])
        if value == 7:
            # Reached only with GPUs (seven of them).
            raise ConfigError("seven GPUs")
        if value == 5:
            sys.exit(2)
        if value == 4:
            sys.exit(1)  # not bad input: not a refusal
        raise ValueError("not tfdist's refusal either")
    ''')


def package_of(tmp_path):
    package = tmp_path / "package"
    package.mkdir()
    (package / "checks.py").write_text(SOURCE)
    return package


def test_every_raise_of_a_config_error_and_every_exit_2_is_found(tmp_path):
    found = refusals.refusals(package_of(tmp_path))
    assert [(refusal.line, refusal.needs) for refusal in found] == [
        (12, ""), (14, ""), (16, ""), (19, "GPUs"), (21, "")]
    assert found[0].text == 'raise ConfigError(f"value must be >= 0. Received: {value}")'


def test_tfdist_has_its_refusals_found():
    found = refusals.refusals()
    names = {refusal.path.name for refusal in found}
    assert len(found) > 140 and {"config.py", "cluster.py", "launch.py", "flags.py"} <= names
    assert any("sys.exit(2)" in refusal.text for refusal in found)


def write_data(path, lines):
    data = coverage.CoverageData(str(path))
    data.add_lines({str(file): lines for file, lines in lines.items()})
    data.write()


def test_a_refusal_no_test_reached_fails_the_report(tmp_path, capsys):
    package = package_of(tmp_path)
    source = package / "checks.py"
    write_data(tmp_path / "some", {source: [11, 12, 13, 14, 15, 16]})
    assert refusals.main([str(tmp_path / "some")], package) == 1
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == ("3 of 5 refusals in package/ were reached by the tests; 1 need what "
                          "this machine lacks")
    assert printed[1].startswith("  needs GPUs: ")
    assert printed[1].endswith(':19: raise ConfigError("seven GPUs")')
    assert printed[2].startswith("  not reached: ") and printed[2].endswith(":21: sys.exit(2)")
    # Every line but the one that needs GPUs: nothing is missed.
    write_data(tmp_path / "all", {source: [12, 14, 16, 21]})
    assert refusals.main([str(tmp_path / "all"), "--json"], package) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["reached"] == 4 and report["unreached"] == [] and len(report["needs"]) == 1


def test_without_a_data_file_it_says_how_to_make_one(tmp_path, capsys):
    assert refusals.main([str(tmp_path / "absent")]) == 2
    assert "run `make refusals`" in capsys.readouterr().err
