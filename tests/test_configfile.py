"""``--config FILE``: a TOML file's settings become a command's defaults; flags override; bad keys are refused."""

from __future__ import annotations

import tomllib

import pytest

from specdecode.cli import build_parser, main
from specdecode.configfile import parse_with_config, toml_value, write_toml
from specdecode.errors import SpecDecodeError


def _write(tmp_path, text: str, name: str = "s.toml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_top_level_and_tables(tmp_path):
    path = _write(tmp_path, 'target = "smollm2-135m"\ndraft = "layer-skip"\nnum_speculative_tokens = 3\n'
                            'skip-layers = "3,5"\nthreads = 2\n\n[generate]\nmax_new_tokens = 40\nchat = false\n'
                            'stop = ["END"]\n\n[serve]\nport = 9001\npolicy = "fixed"\n\n[bench]\ngamma = 6\n'
                            'methods = "ngram:k=6"\nquick = true\n\n[tune]\nanything = 1\n')
    gen = parse_with_config(build_parser(), ["generate", "--config", path])
    assert (gen.draft, gen.num_speculative_tokens, gen.skip_layers, gen.threads) == ("layer-skip", 3, "3,5", 2)
    assert (gen.max_new_tokens, gen.chat, gen.stop, gen.policy) == (40, False, ["END"], "auto")
    srv = parse_with_config(build_parser(), ["serve", f"--config={path}", "--port", "9100"])
    assert (srv.draft, srv.port, srv.policy, srv.threads) == ("layer-skip", 9100, "fixed", 2)
    no_adaptive = _write(tmp_path, '[serve]\nno-adaptive = true\n', "n.toml")  # a flag's name: true gives the flag
    assert parse_with_config(build_parser(), ["serve", "--config", no_adaptive]).policy == "fixed"
    heuristic = _write(tmp_path, '[serve]\npolicy = "heuristic"\n', "h.toml")
    assert parse_with_config(build_parser(), ["serve", "--config", heuristic]).policy == "heuristic"
    adaptive = _write(tmp_path, '[serve]\nadaptive = true\n[generate]\nno-chat = true\n', "a.toml")
    assert parse_with_config(build_parser(), ["serve", "--config", adaptive]).policy == "cost-model"
    assert parse_with_config(build_parser(), ["generate", "--config", adaptive]).chat is False
    bench = parse_with_config(build_parser(), ["bench", "--config", path])
    assert (bench.gamma, bench.methods, bench.preset, bench.draft) == (6, "ngram:k=6", "quick", None)
    plain = parse_with_config(build_parser(), ["generate"])  # no file: the parser's own defaults
    assert (plain.draft, plain.num_speculative_tokens) == ("ngram", 5)


def test_a_top_level_key_only_one_command_takes_is_skipped_by_the_other(tmp_path, capsys):
    """Top-level keys are generate / serve settings: ``port`` (serve only) and ``max_new_tokens`` (generate only) at the
    top level configure their command and the other command runs without them; a key neither takes is refused."""
    path = _write(tmp_path, 'port = 8001\nmax_new_tokens = 7\nnum_speculative_tokens = 3\n')
    gen = parse_with_config(build_parser(), ["generate", "--config", path])
    assert (gen.max_new_tokens, gen.num_speculative_tokens) == (7, 3)
    assert "top-level port: 'specdecode serve' settings, skipped by 'specdecode generate'" in capsys.readouterr().err
    srv = parse_with_config(build_parser(), ["serve", "--config", path])
    assert (srv.port, srv.num_speculative_tokens) == (8001, 3)
    err = capsys.readouterr().err
    assert "top-level max_new_tokens: 'specdecode generate' settings, skipped by 'specdecode serve'" in err
    assert len(err.strip().splitlines()) == 1
    for command in ("generate", "serve"):
        with pytest.raises(SpecDecodeError, match="unknown key 'nonsense'"):
            parse_with_config(build_parser(), [command, "--config", _write(tmp_path, 'nonsense = 1\n', "x.toml")])


@pytest.mark.parametrize("text,match", [
    ('nonsense = 1\n', "unknown key 'nonsense' for 'specdecode generate'"),
    ('num_speculative_token = 4\n', "did you mean num_speculative_tokens"),
    ('gama = 4\n', "did you mean gamma"),  # a flag's other long name is a key, so it is suggested too
    ('num_speculative_tokens = "four"\n', "key 'num_speculative_tokens' .* must be an integer"),
    ('num_speculative_tokens = true\n', "must be an integer"),
    ('temperature = "hot"\n', "must be a number"),
    ('policy = "fastest"\n', "key 'policy' .* must be one of auto, fixed, heuristic"),
    ('[generate]\nchat = "yes"\n', "is a switch: write true or false"),
    ('[generate]\nport = 80\n', "unknown key 'port'"),
    ('[gen]\nx = 1\n', r"unknown table \[gen\]"),
    ('draft = ["ngram"]\n', "takes one value"),
    ('target = \n', "not valid TOML"),
])
def test_bad_settings_name_the_key_and_the_file(tmp_path, text, match):
    path = _write(tmp_path, text)
    with pytest.raises(SpecDecodeError, match=match) as err:
        parse_with_config(build_parser(), ["generate", "--config", path])
    assert path in str(err.value)


def test_missing_file_and_cli_errors(tmp_path, capsys):
    with pytest.raises(SpecDecodeError, match="no such file"):
        parse_with_config(build_parser(), ["generate", "--config", str(tmp_path / "none.toml")])
    with pytest.raises(SpecDecodeError, match="needs a FILE"):
        parse_with_config(build_parser(), ["generate", "--config"])
    bad = _write(tmp_path, "threads = 0.5\n")
    assert main(["generate", "--config", bad, "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --config") and "'threads'" in err and len(err.strip().splitlines()) == 1


def test_a_value_the_command_refuses_names_the_file_that_set_it(tmp_path, capsys):
    """A setting of the right type but out of range is refused where the flag's would be, and the line says the
    file and key that set it; a flag given on the command line instead is not blamed on the file."""
    cfg = _write(tmp_path, "[generate]\nnum_speculative_tokens = 0\n")
    assert main(["generate", "--config", cfg, "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "--num-speculative-tokens" in err and f"(set by --config {cfg}: num_speculative_tokens = 0)" in err
    assert len(err.strip().splitlines()) == 1
    for given in (["--num-speculative-tokens", "0"], ["-k70"], ["--num-spec", "0"], ["--gamma=0"]):  # any form
        assert main(["generate", "--config", cfg, "--prompt", "x", *given]) == 2
        assert "set by --config" not in capsys.readouterr().err, given
    # the error's subject is the first flag it names: --draft-weights (given here), not the file's weights
    both = _write(tmp_path, 'weights = "int4"\ndraft = "smollm2-135m"\n')
    assert main(["generate", "--config", both, "--prompt", "x", "--draft", "ngram", "--draft-weights", "int8"]) == 2
    err = capsys.readouterr().err
    assert "--draft-weights" in err and "set by --config" not in err
    # the key as the file wrote it: a flag's other long name, dashes kept
    for key in ("gamma", "num-speculative-tokens"):
        cfg = _write(tmp_path, f"[generate]\n{key} = 0\n")
        assert main(["generate", "--config", cfg, "--prompt", "x"]) == 2
        assert f"(set by --config {cfg}: {key} = 0)" in capsys.readouterr().err


def test_writer_round_trips():
    assert tomllib.loads("x = " + toml_value({"a": [1, 2.5, "q\"uote"], "b": True, "c": None}))["x"] == \
        {"a": [1, 2.5, 'q"uote'], "b": True}
    with pytest.raises(ValueError):
        toml_value(float("nan"))


def test_write_toml(tmp_path):
    path = write_toml(tmp_path / "w.toml", {"draft": "ngram", "skip": None}, {"tune": {"k": 1}},
                      comments=["hello", "→ unicode"], arrays={"tune.rows": [{"m": "a"}, {"m": "b"}]})
    data = tomllib.loads(path.read_text())
    assert data == {"draft": "ngram", "tune": {"k": 1, "rows": [{"m": "a"}, {"m": "b"}]}}
    assert path.read_text().startswith("# hello\n")


def test_one_setting_under_two_names(tmp_path):
    """Two keys of one scope for one setting are refused in one line; a command's table overrides the top level
    setting by setting, whatever name each gave it; the key a message names is the one that set the value."""
    from specdecode.configfile import apply_config

    def generate_with(text, name):
        return parse_with_config(build_parser(), ["generate", "--config", _write(tmp_path, text, name), "--prompt", "x"])

    for i, text in enumerate(("gamma = 4\nnum_speculative_tokens = 5\n",
                              "[generate]\ngamma = 4\nnum-speculative-tokens = 5\n", "chat = true\nno_chat = true\n")):
        with pytest.raises(SpecDecodeError, match=r"keys '\S+' and '\S+' both set .*keep one"):
            generate_with(text, f"two{i}.toml")
    assert generate_with("gamma = 6\n[generate]\nnum_speculative_tokens = 8\n", "a.toml").num_speculative_tokens == 8
    assert generate_with("num_speculative_tokens = 6\n[generate]\ngamma = 3\n", "b.toml").num_speculative_tokens == 3
    settings = apply_config(build_parser(), ["bench", "--config", _write(tmp_path, "[bench]\nsmoke = true\nquick = false\n",
                                                                         "c.toml")])
    assert settings["preset"] == "smoke" and settings.written["preset"] == "smoke"  # quick = false set nothing
