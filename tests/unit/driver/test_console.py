"""The quiet console of a training run: everything to the run's log, only user lines to the terminal. With other
processes (children, Ray, a real run) in ``tests/integration/cli/test_console.py``."""

from __future__ import annotations

import os
import time

from pretrain.driver.console import QuietConsole, user_line


def test_user_lines_are_ours_without_ray_prefixes():
    assert user_line("[train] step 4/4 | loss 8.0\n") == "[train] step 4/4 | loss 8.0\n"
    assert (
        user_line("\x1b[36m(RayTrainWorker pid=6503)\x1b[0m [train] checkpoint committed: step 4\n")
        == "[train] checkpoint committed: step 4\n"
    )
    assert user_line("(RayTrainWorker pid=7, ip=10.0.0.2) error: data.sources: x\n") == "error: data.sources: x\n"
    for noise in (
        "\x1b[36m(TrainController pid=6367)\x1b[0m [2026-11-23 13:47:34,160 E 6367 6407] core_worker.cc:2465: "
        "Actor with class name: 'PreemptionWatcher'\n",
        "2026-11-23 13:47:16,201\tWARNING authentication_token_setup.py:85 -- Token authentication is enabled\n",
        "[2026-11-23 13:46:35,018] [WARNING] [real_accelerator.py:213:get_accelerator] Setting accelerator\n",
        "Traceback (most recent call last):\n",
        "(RayTrainWorker pid=9) Traceback (most recent call last):\n",
    ):
        assert user_line(noise) is None, noise


def test_lines_before_the_log_exists_are_held_and_written_first(tmp_path, capfd):
    """The run's log is known only once the run is created, while Ray already starts: what came before is held
    and opens the log; user lines reach the terminal at once either way."""
    log = tmp_path / "run" / "logs" / "driver.log"
    with QuietConsole(None, verbose=False) as console:
        os.write(2, b"WARNING Token authentication is enabled\n")
        os.write(1, b"[pretrain] tokenizer: reused\n")
        time.sleep(0.2)
        assert not log.exists()
        console.set_log(log)
        os.write(1, b"[train] step 1\n")
    out, _ = capfd.readouterr()
    assert out.splitlines() == ["[pretrain] tokenizer: reused", "[train] step 1"]
    assert log.read_text().splitlines() == [
        "WARNING Token authentication is enabled",
        "[pretrain] tokenizer: reused",
        "[train] step 1",
    ]


# -- errors through the CLI ------------------------------------------------------------------------------------


def test_cli_errors_user_one_line_internal_traceback(monkeypatch, capsys):
    from pretrain import cli

    def raiser(exc):
        def cmd(args):
            raise exc

        return cmd

    internal = RuntimeError("boom")
    internal.add_note("full log: /x/logs/driver.log")
    # what a worker's ConfigError looks like after Ray wrapped it (only text survives)
    wrapped = RuntimeError(
        'Training failed.\nTraceback (most recent call last):\n  File "w.py", line 3\n'
        "pretrain.config.errors.ConfigError: data.sources[0].path: /c.jsonl: no file matches"
    )
    from pretrain.train.stability.monitor import StabilityHaltError

    cases = [
        (internal, 1, None),
        (wrapped, 2, "error: data.sources[0].path: /c.jsonl: no file matches"),
        (StabilityHaltError("stability halt at step 3: nonfinite"), 1, "error: stability halt at step 3: nonfinite"),
    ]
    for exc, code, line in cases:
        monkeypatch.setitem(cli.COMMANDS, "train", raiser(exc))
        assert cli.main(["train"]) == code
        err = capsys.readouterr().err
        if line is None:  # internal: the traceback, its notes, and the root cause
            assert "Traceback" in err and "full log: /x/logs/driver.log" in err
            assert err.strip().splitlines()[-1] == "error: internal error: RuntimeError: boom"
        else:
            assert err.strip().splitlines() == [line]


def test_a_reader_that_stops_reading_ends_the_command_quietly(tmp_path):
    """``./launch.sh runs | head -1``: the command's stdout closes under it; it ends with SIGPIPE's status and no
    traceback, as ``ls | head`` does."""
    import subprocess
    import sys

    script = (
        "import sys\nfrom pretrain import cli\n"
        "cli.COMMANDS['runs'] = lambda rest: [print(f'line {i}', flush=True) for i in range(10**6)] and 0\n"
        "sys.exit(cli.main(['runs']))\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "line 0\n"
    proc.stdout.close()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 141 and err == "", err


def test_a_broken_pipe_that_is_not_stdout_is_an_error(monkeypatch, capsys):
    from pretrain import cli

    def broken(rest):
        raise BrokenPipeError(32, "Broken pipe")  # a dead subprocess's pipe, not the terminal's reader

    monkeypatch.setitem(cli.COMMANDS, "runs", broken)
    assert cli.main(["runs"]) == 1
    assert capsys.readouterr().err.splitlines()[-1] == "error: internal error: BrokenPipeError: [Errno 32] Broken pipe"
