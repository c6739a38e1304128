"""Thread counts are bounded by what the machine has, everywhere a thread count is taken: the ``--threads`` of
generate, serve, bench, tune, audit and train-drafter, a ``--config`` file, and the library's configs
(``validate.check_threads``, one copy). ``--threads 1000`` on 2 cores once loaded the machine to 295 with no
progress for 5 minutes."""

from __future__ import annotations

import pytest

from specdecode.errors import SpecDecodeError
from specdecode.validate import check_threads, usable_cores

TOO_MANY = usable_cores() + 1


def test_the_bound_is_the_cores_this_process_may_use():
    cores = usable_cores()
    check_threads(None)
    check_threads(1)
    check_threads(cores)
    with pytest.raises(SpecDecodeError) as info:
        check_threads(1000, cores=2)
    message = str(info.value)
    assert message.startswith("--threads 1000:") and "2 cores" in message and "1..2" in message
    for bad in (0, -1, 2.5, True, "4"):
        with pytest.raises(SpecDecodeError, match="positive integer"):
            check_threads(bad)
    check_threads(1000, bound=False)  # a replica on another machine of a cluster: bounded where it runs


@pytest.mark.parametrize("argv", [
    ["generate", "--prompt", "hi"],
    ["serve"],
    ["bench", "--smoke"],
    ["bench", "--verify-table"],
    ["tune", "--dataset", "humaneval:1"],
    ["audit", "--local", "--prompt", "hi"],
    ["train-drafter"],
])
def test_every_command_refuses_more_threads_than_cores(capsys, argv):
    from specdecode.cli import main

    assert main([*argv, "--threads", str(TOO_MANY)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --threads {TOO_MANY}:") and "cores" in err[0], err


def test_a_config_file_is_bounded_too(tmp_path, capsys):
    from specdecode.cli import main

    path = tmp_path / "c.toml"
    path.write_text(f"threads = {TOO_MANY}\n")
    assert main(["generate", "--config", str(path), "--prompt", "hi"]) == 2
    assert f"--threads {TOO_MANY}:" in capsys.readouterr().err


def test_the_library_configs_are_bounded():
    from specdecode.bench.runner import BenchConfig
    from specdecode.cliargs import set_threads
    from specdecode.eagle.train import TrainConfig
    from specdecode.tune import TuneConfig

    for build in (lambda: BenchConfig(threads=TOO_MANY), lambda: TrainConfig(threads=TOO_MANY),
                  lambda: TuneConfig(target="x", datasets=("humaneval:1",), threads=TOO_MANY),
                  lambda: set_threads(TOO_MANY)):
        with pytest.raises(SpecDecodeError, match="cores"):
            build()


def test_the_command_line_takes_threads_auto_as_the_library_does(tmp_path):
    """--threads auto (and threads = "auto" in a settings file) is the default, one thread per idle core; other
    text is refused by the parser in one line."""
    import argparse

    from specdecode.cli import build_parser
    from specdecode.cliargs import threads_arg
    from specdecode.configfile import parse_with_config

    assert build_parser().parse_args(["generate", "--threads", "AUTO"]).threads is None
    assert build_parser().parse_args(["generate", "--threads", "2"]).threads == 2
    cfg = tmp_path / "t.toml"
    cfg.write_text('threads = "auto"\n')
    assert parse_with_config(build_parser(), ["generate", "--config", str(cfg)]).threads is None
    with pytest.raises(argparse.ArgumentTypeError, match="whole number of threads or auto"):
        threads_arg("two")
