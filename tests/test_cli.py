"""CLI: inspect (text and --json) and verify (exit codes, naming bad tensors); every command's
--json object; user errors as one line and exit 2 (never a traceback); Ctrl-C while starting
up and during a reshard; a killed reshard's temporary swept by the next; a closed stdout;
progress; reshard --drop-role; export --config and its warning without a config."""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

import unickpt
from tests.clirun import cli, cli_process  # cli: in this process (close to a fresh one; see clirun)


def _sigint_default() -> None:
    """In the child before exec: SIGINT as a terminal gives it. A job started in the background
    by a non-interactive shell (CI runners, ``make test &``) inherits SIGINT ignored, and a
    Python started so never raises KeyboardInterrupt: the Ctrl-C tests would hang."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _ckpt(tmp_path):
    sd = {
        "model": {"w": torch.randn(8, 8), "b": torch.zeros(8, dtype=torch.bfloat16)},
        "optimizer": {"exp_avg": {"w": torch.randn(8, 8)}},
    }
    unickpt.save(sd, tmp_path / "step-00000003", step=3, strategy={"zero_stage": 1})
    return tmp_path / "step-00000003"


def test_inspect_json(tmp_path):
    p = _ckpt(tmp_path)
    r = cli_process("inspect", str(tmp_path), "--json")  # `python -m unickpt.cli` itself
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    for k in ("format_version", "step", "tensors", "bytes_by_role", "files", "saved_by"):
        assert k in info
    assert info["step"] == 3 and info["tensors"] == 3
    assert set(info["bytes_by_role"]) == {"model", "optimizer"}
    assert sum(info["bytes_by_role"].values()) == sum(os.path.getsize(p / f) for f in info["files"])
    assert info["saved_by"]["strategy"] == {"zero_stage": 1}
    r = cli("inspect", str(p), "--tensors")
    assert r.returncode == 0 and "model/w" in r.stdout and "optimizer/exp_avg.w" in r.stdout


def test_verify_ok_then_corrupted(tmp_path):
    p = _ckpt(tmp_path)
    r = cli("verify", str(p))
    assert r.returncode == 0 and "ok: 3 tensors" in r.stdout
    _, man = unickpt.read_manifest(p)
    t = man.tensors[("optimizer", "exp_avg.w")]
    with open(p / t.file, "r+b") as f:
        f.seek(man.files[t.file].data_start + t.begin + 17)
        f.write(b"\xff")
    r = cli("verify", str(p))
    assert r.returncode == 1
    assert f"{t.file}: tensor 'exp_avg.w'" in r.stderr and "1 of 3 tensors failed" in r.stderr


def test_not_a_checkpoint(tmp_path):
    r = cli("inspect", str(tmp_path / "nope"))
    assert r.returncode == 2 and "CheckpointNotFoundError" in r.stderr


def test_inspect_and_verify_a_compressed_checkpoint(tmp_path):
    w = torch.randn(64, 48)
    sd = {"model": {"w": w.bfloat16()}, "master": {"w": w},
          "optimizer": {"exp_avg": {"w": torch.randn(64, 48)}, "exp_avg_sq": {"w": torch.rand(64, 48)}}}
    unickpt.save(sd, tmp_path / "ck", quant="O2", master="residual", zstd=5)
    info = json.loads(cli("inspect", str(tmp_path / "ck"), "--json").stdout)
    assert info["compression"]["quant"] == "O2" and info["compression"]["zstd"] == 5
    assert info["codecs"] == {"q4_logw": 1, "q4_logm": 1, "raw": 1, "residual16": 1}
    assert {f["container"] for f in info["files"].values() if f["role"] != "model"} == {"zstd"}
    assert sum(info["bytes_by_role"].values()) == sum(os.path.getsize(tmp_path / "ck" / f) for f in info["files"])
    text = cli("inspect", str(tmp_path / "ck"), "--tensors").stdout
    assert "compression  quant O2, master residual, zstd 5" in text and "[q4_logm]" in text
    r = cli("verify", str(tmp_path / "ck"))
    assert r.returncode == 0, r.stderr


# --- one JSON object, one error line, never a traceback ------------------------------------


def _one_line(r, code=2):
    """Exit ``code``, one line on stderr naming the problem, no traceback."""
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    return r.stderr.strip()


def _json(r):
    """stdout is exactly one JSON object."""
    obj = json.loads(r.stdout)
    assert isinstance(obj, dict)
    return obj


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_every_command_prints_one_json_object_with_its_figures(tmp_path):
    import torch.distributed.checkpoint as dcp

    p = _ckpt(tmp_path)
    dcp.save({"model": {"w": torch.randn(4, 4)}}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    runs = {
        "inspect": ("inspect", str(p)),
        "verify": ("verify", str(p)),
        "export": ("export", str(p), str(tmp_path / "hf")),
        "reshard": ("reshard", str(p), str(tmp_path / "re"), "--max-file-size", "1KiB"),
        "convert": ("convert", "--from-dcp", str(tmp_path / "dcp"), str(tmp_path / "conv")),
    }
    for cmd, argv in runs.items():  # each in a process: what a user's shell sees, warn-once warnings included
        r = cli_process(*argv, "--json")
        assert r.returncode == 0, r.stderr
        obj = _json(r)
        assert obj["command"] == cmd and obj["ok"] is True and obj["exit_code"] == 0 and "error" not in obj
        assert "Traceback" not in r.stderr
        if cmd != "inspect":
            assert {"bytes", "seconds", "gbps"} <= set(obj), obj
    assert _json(cli("verify", str(p), "--json"))["bad"] == []
    assert unickpt.read_manifest(tmp_path / "conv")[1].tensors


def _file_and_dir(tmp_path):
    f = tmp_path / "a-file"
    f.write_text("not a checkpoint")
    return f, _ckpt(tmp_path)


ERROR_CASES = {
    "missing path": (lambda f, ck, t: ["inspect", str(t / "nope")], "CheckpointNotFoundError"),
    "file as checkpoint (inspect)": (lambda f, ck, t: ["inspect", str(f)], "CheckpointNotFoundError"),
    "file as checkpoint (verify)": (lambda f, ck, t: ["verify", str(f)], "CheckpointNotFoundError"),
    "file as checkpoint (export)": (lambda f, ck, t: ["export", str(f), str(t / "hf")], "CheckpointNotFoundError"),
    "file as checkpoint (reshard)": (lambda f, ck, t: ["reshard", str(f), str(t / "o")], "CheckpointNotFoundError"),
    "file as destination": (lambda f, ck, t: ["reshard", str(ck), str(f)], "CheckpointExistsError"),
    "path under a file": (lambda f, ck, t: ["export", str(ck), str(f / "x")], "Error"),
    "not a DCP directory": (lambda f, ck, t: ["convert", "--from-dcp", str(f), str(t / "c")], "FormatError"),
    "bad size": (lambda f, ck, t: ["reshard", str(ck), str(t / "o"), "--max-file-size", "12QB"], "InvalidArgumentError"),
    "bad shard size": (lambda f, ck, t: ["export", str(ck), str(t / "o"), "--max-shard-size", "-5"], "InvalidArgumentError"),
    "bad choice": (lambda f, ck, t: ["reshard", str(ck), str(t / "o"), "--quant", "O9"], "UsageError"),
    "not an int": (lambda f, ck, t: ["reshard", str(ck), str(t / "o"), "--zstd", "x"], "UsageError"),
    "int out of range": (lambda f, ck, t: ["reshard", str(ck), str(t / "o"), "--zstd", "99"], "InvalidArgumentError"),
    "int below range": (lambda f, ck, t: ["reshard", str(ck), str(t / "o"), "--zstd", "0"], "InvalidArgumentError"),
    "zero size": (lambda f, ck, t: ["reshard", str(ck), str(t / "o"), "--max-file-size", "0"], "InvalidArgumentError"),
    "empty size": (lambda f, ck, t: ["reshard", str(ck), str(t / "o"), "--max-file-size", ""], "InvalidArgumentError"),
    "missing config": (lambda f, ck, t: ["export", str(ck), str(t / "hf"), "--config", str(t / "none.json")],
                       "InvalidArgumentError"),
    "unknown role": (lambda f, ck, t: ["reshard", str(ck), str(t / "o"), "--drop-role", "nope"], "InvalidArgumentError"),
    "storage options not an object": (lambda f, ck, t: ["--storage-options", "[1]", "verify", str(ck)], "UsageError"),
    "storage options after the command": (lambda f, ck, t: ["verify", str(ck), "--storage-options", "{x"], "UsageError"),
    "storage options nested deep": (lambda f, ck, t: ["verify", str(ck), "--storage-options", "[" * 100_000], "UsageError"),
    "storage options NaN": (lambda f, ck, t: ["verify", str(ck), "--storage-options", '{"a": NaN}'], "UsageError"),
    "storage options twice": (lambda f, ck, t: ["--storage-options", "{}", "verify", "--storage-options", '{"a": 1}',
                                                str(ck)], "UsageError"),
    "missing argument": (lambda f, ck, t: ["export", str(ck)], "UsageError"),
    "unknown command": (lambda f, ck, t: ["frobnicate", str(ck)], "UsageError"),
}


@pytest.mark.parametrize("case", sorted(ERROR_CASES))
def test_user_errors_are_one_line_exit_2_and_a_json_error(tmp_path, case):
    argv, kind = ERROR_CASES[case]
    f, ck = _file_and_dir(tmp_path)
    r = cli(*argv(f, ck, tmp_path), "--json")
    line = _one_line(r)
    obj = _json(r)
    assert obj["ok"] is False and obj["exit_code"] == 2 and kind in obj["error"]["type"], obj
    assert obj["error"]["message"] and obj["error"]["message"].splitlines()[0] in line
    assert not (tmp_path / "o").exists() and not (tmp_path / "hf").exists()
    if case.startswith("file as checkpoint") or case == "not a DCP directory":
        assert f"{f}: is a file, not a " in line, line
    if "range" in case:
        assert "from 1 to 22" in line, line


def test_an_existing_destination_names_the_overwrite_option(tmp_path):
    """The CLI says ``--overwrite``; the library keeps ``overwrite=True``."""
    import torch.distributed.checkpoint as dcp

    from unickpt.errors import CheckpointExistsError
    from unickpt.offline import reshard_offline

    p = _ckpt(tmp_path)
    with pytest.warns(UserWarning, match="torch.distributed is disabled"):
        dcp.save({"model": {"w": torch.randn(4, 4)}}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    (tmp_path / "hf").mkdir()
    for argv in (["reshard", str(p), str(p)], ["convert", "--from-dcp", str(tmp_path / "dcp"), str(p)],
                 ["export", str(p), str(tmp_path / "hf")]):
        r = cli(*argv, "--json", "-q")
        line = _one_line(r)
        assert "CheckpointExistsError" in line and "--overwrite" in line and "overwrite=True" not in line, line
        assert "overwrite=True" not in _json(r)["error"]["message"]
    with pytest.raises(CheckpointExistsError, match="overwrite=True"):
        reshard_offline(p, p)


def test_export_to_an_existing_destination_is_refused_before_anything_else(tmp_path):
    """No config warnings of transformers (a config whose token ids lie outside its vocabulary)
    before the error about DST: that error comes alone."""
    cfg = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 100, "n_layer": 1, "n_embd": 8,
           "n_head": 2, "n_positions": 16, "bos_token_id": 50256, "eos_token_id": 50256}
    unickpt.save({"model": {"w": torch.randn(4, 4)}}, tmp_path / "ck", extra_files={"config.json": json.dumps(cfg)})
    (tmp_path / "hf").mkdir()
    # a process: transformers' warnings go to the stderr its handler was made with, which in
    # this process may be an earlier test's
    line = _one_line(cli_process("export", str(tmp_path / "ck"), str(tmp_path / "hf")))
    assert "CheckpointExistsError" in line and "already exists" in line
    assert os.listdir(tmp_path / "hf") == []


def test_export_without_a_config_warns_that_the_folder_will_not_load(tmp_path):
    p = _ckpt(tmp_path)  # saved without a config.json
    r = cli("export", str(p), str(tmp_path / "hf"), "--json", "-q")
    assert r.returncode == 0, r.stderr
    (warning,) = _json(r)["warnings"]
    assert "no config.json" in warning and "from_pretrained" in warning and "--config" in warning
    assert r.stderr.strip().splitlines() == [f"unickpt export: warning: {warning}"]
    assert not (tmp_path / "hf" / "config.json").exists()
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    r = cli("export", str(p), str(tmp_path / "hf2"), "--config", str(tmp_path / "config.json"), "--json", "-q")
    assert r.returncode == 0 and r.stderr == "" and "warnings" not in _json(r)


def test_convert_prints_no_dcp_warning(tmp_path):
    import torch.distributed.checkpoint as dcp

    with pytest.warns(UserWarning, match="torch.distributed is disabled"):
        dcp.save({"model": {"w": torch.randn(4, 4)}}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    r = cli_process("convert", "--from-dcp", str(tmp_path / "dcp"), str(tmp_path / "conv"), "-q")
    assert r.returncode == 0 and r.stderr == "", r.stderr


def test_without_json_an_error_writes_nothing_on_stdout(tmp_path):
    f, ck = _file_and_dir(tmp_path)
    for argv in (["verify", str(f)], ["reshard", str(ck), str(tmp_path / "o"), "--max-file-size", "12QB"],
                 ["reshard", str(ck), str(tmp_path / "o"), "--quant", "O9"]):
        r = cli(*argv)
        line = _one_line(r)
        assert r.stdout == "" and line.startswith(f"unickpt {argv[0]}: ")
    assert "--quant" in line and "unickpt reshard --help" in line


def test_a_failed_verification_exits_1_with_the_damage_in_json(tmp_path):
    p = _ckpt(tmp_path)
    _, man = unickpt.read_manifest(p)
    t = man.tensors[("model", "w")]
    with open(p / t.file, "r+b") as fh:
        fh.seek(man.files[t.file].data_start + t.begin)
        fh.write(b"\x00\x01\x02\x03")
    r = cli("verify", str(p), "--json", "-q")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    obj = _json(r)
    assert obj["ok"] is False and obj["exit_code"] == 1 and obj["error"]["type"] == "ChecksumError"
    assert [(b["file"], b["tensor"]) for b in obj["bad"]] == [(t.file, "w")]
    assert r.stderr.strip() == "unickpt verify: 1 of 3 tensors failed verification"


@pytest.mark.parametrize("as_json", [False, True])
def test_inspect_into_a_closed_pipe_exits_141_quietly(tmp_path, as_json):
    """``unickpt inspect --tensors [--json] | head -1``: the reader leaves after one line, with
    far more than a pipe buffer still to come. Normal use: nothing on stderr, exit 141 (what a
    shell reports for a tool SIGPIPE ended)."""
    names = {f"layers.{i}.a_rather_long_parameter_name_to_fill_the_pipe.weight": torch.zeros(1) for i in range(1500)}
    unickpt.save({"model": names}, tmp_path / "ck")
    proc = subprocess.Popen([sys.executable, "-m", "unickpt.cli", "inspect", str(tmp_path / "ck"), "--tensors",
                             *(["--json"] if as_json else [])],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = proc.stdout.readline()
    proc.stdout.close()  # what head does after its line
    err = proc.stderr.read()
    proc.wait()
    assert first.startswith("{" if as_json else "checkpoint")
    assert proc.returncode == 141 and err == "", err


# The slowed-down children below sleep in 0.1 s slices, not one long sleep: SIGINT sent to the
# process may be taken by one of its other threads (torch's, a reader pool's), and Python runs
# the handler in the main thread only at its next bytecode; a main thread inside one
# ``sleep(600)`` is not woken by a signal another thread took (the likely cause of a hang seen
# once under load, where ``communicate(timeout=60)`` expired).
SLOW_VERIFY = """
import sys, time
import unickpt.loading.verify
real = unickpt.loading.verify.check_stored
def slow(*a, **k):
    print("checking", file=sys.stderr, flush=True)
    for _ in range(6000):  # (slices: see above SLOW_VERIFY)
        time.sleep(0.1)
    return real(*a, **k)
unickpt.loading.verify.check_stored = slow
import unickpt.cli
sys.exit(unickpt.cli.main(sys.argv[1:]))
"""


def test_ctrl_c_during_verify_exits_2_with_one_line(tmp_path):
    """A real SIGINT while verify reads (a reader slowed down so the signal lands mid-read)."""
    p = _ckpt(tmp_path)
    proc = subprocess.Popen([sys.executable, "-c", SLOW_VERIFY, "verify", str(p), "-q"],
                            preexec_fn=_sigint_default, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stderr.readline().strip() == "checking"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and out == ""
    assert err.strip().splitlines() == ["unickpt verify: interrupted (Ctrl-C)"]


SLOW_START = """
import sys, time
import unickpt.cli as cli
real = cli._start_up
def slow():
    print("starting", file=sys.stderr, flush=True)
    for _ in range(6000):  # (slices: see above SLOW_VERIFY)
        time.sleep(0.1)
    real()
cli._start_up = slow
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("as_json", [False, True])
def test_ctrl_c_while_starting_up_exits_2_with_one_line(tmp_path, as_json):
    """A real SIGINT while the CLI imports torch and its readers (made slow so the signal lands
    there): the same one line as later, no traceback."""
    p = _ckpt(tmp_path)
    proc = subprocess.Popen([sys.executable, "-c", SLOW_START, "inspect", str(p), *(["--json"] if as_json else [])],
                            preexec_fn=_sigint_default, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stderr.readline().strip() == "starting"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, (out, err)
    assert err.strip().splitlines() == ["unickpt inspect: interrupted (Ctrl-C)"]
    if as_json:
        assert _json(subprocess.CompletedProcess([], 2, out, err))["error"]["type"] == "KeyboardInterrupt"
    else:
        assert out == ""


def test_the_cli_module_imports_nothing_heavy_itself():
    """torch and the readers load in ``main`` (under its Ctrl-C handling), not with the module."""
    import ast
    from unickpt import cli

    tree = ast.parse(open(cli.__file__).read())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = {a.name for n in top if isinstance(n, ast.Import) for a in n.names}
    names |= {("." * n.level) + (n.module or "") for n in top if isinstance(n, ast.ImportFrom)}
    assert names <= {"__future__", "argparse", "json", "logging", "os", "sys", "time", "traceback", "warnings", "typing",
                     "._version", "._metrics", ".errors"}, names


SLOW_RESHARD = """
import sys, time
import unickpt.offline
real, calls = unickpt.offline.read_whole, []
def slow(*a, **k):
    calls.append(1)
    if len(calls) == 2:  # one tensor written, the temporary holds data
        print("writing", file=sys.stderr, flush=True)
        for _ in range(6000):  # (slices: see above SLOW_VERIFY)
            time.sleep(0.1)
    return real(*a, **k)
unickpt.offline.read_whole = slow
import unickpt.cli
sys.exit(unickpt.cli.main(sys.argv[1:]))
"""


def _temporaries(root):
    return [n for n in os.listdir(root) if ".tmp-" in n]


def test_a_killed_reshard_is_swept_by_the_next_and_ctrl_c_leaves_nothing(tmp_path):
    p = _ckpt(tmp_path)
    root = tmp_path / "out"
    root.mkdir()
    dst = root / "re"
    proc = subprocess.Popen([sys.executable, "-c", SLOW_RESHARD, "reshard", str(p), str(dst), "-q"],
                            preexec_fn=_sigint_default, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stderr.readline().strip() == "writing"
    proc.kill()  # kill -9 mid-way
    proc.communicate(timeout=60)
    (tmp,) = _temporaries(root)
    assert tmp.startswith(".re.tmp-") and any(n.endswith(".safetensors") for n in os.listdir(root / tmp))
    r = cli("reshard", str(p), str(dst), "-q")
    assert r.returncode == 0, r.stderr
    assert os.listdir(root) == ["re"] and cli("verify", str(dst), "-q").returncode == 0

    dst2 = root / "re2"
    proc = subprocess.Popen([sys.executable, "-c", SLOW_RESHARD, "reshard", str(p), str(dst2), "-q"],
                            preexec_fn=_sigint_default, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stderr.readline().strip() == "writing"
    assert _temporaries(root)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and err.strip().splitlines() == ["unickpt reshard: interrupted (Ctrl-C)"]
    assert os.listdir(root) == ["re"]


def test_an_interrupt_inside_begin_removes_the_temporary(tmp_path, monkeypatch):
    from unickpt.io import commit
    from unickpt.offline import reshard_offline

    p = _ckpt(tmp_path)
    real = commit.Transaction.begin

    def begin_then_interrupted(self):
        real(self)
        raise KeyboardInterrupt

    monkeypatch.setattr(commit.Transaction, "begin", begin_then_interrupted)
    (tmp_path / "out").mkdir()
    with pytest.raises(KeyboardInterrupt):
        reshard_offline(p, tmp_path / "out" / "re")
    assert os.listdir(tmp_path / "out") == []


def test_a_second_ctrl_c_does_not_interrupt_the_cleanup():
    import time

    from unickpt.offline import _interrupts_held

    before = signal.getsignal(signal.SIGINT)
    with _interrupts_held():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # (the handler runs between bytecodes: ignored here)
    assert signal.getsignal(signal.SIGINT) is before


def test_keyboard_interrupt_is_in_the_json_object(tmp_path, monkeypatch, capsys):
    from unickpt import cli

    p = _ckpt(tmp_path)

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "verify_checkpoint", interrupted)
    assert cli.main(["verify", str(p), "--json"]) == 2
    out, err = capsys.readouterr()
    assert json.loads(out)["error"]["type"] == "KeyboardInterrupt"
    assert err == "unickpt verify: interrupted (Ctrl-C)\n"


def test_an_internal_bug_is_one_line_and_a_hint_its_traceback_only_with_debug(tmp_path, monkeypatch, capsys):
    from unickpt import cli

    p = _ckpt(tmp_path)

    def buggy(ckpt, man, progress=None, **kw):
        return None + 1

    monkeypatch.setattr(cli, "verify_checkpoint", buggy)
    monkeypatch.delenv("UNICKPT_DEBUG", raising=False)
    assert cli.main(["verify", str(p), "--json"]) == 3
    out, err = capsys.readouterr()
    assert json.loads(out)["error"]["type"] == "TypeError"
    assert len(err.splitlines()) == 1 and "internal error: TypeError" in err and "--debug" in err
    assert "NoneType" in err, err  # the bug itself, not a call that failed before it ran
    with pytest.raises(TypeError):
        cli.main(["verify", str(p), "--debug"])
    monkeypatch.setenv("UNICKPT_DEBUG", "1")
    with pytest.raises(TypeError):
        cli.main(["verify", str(p)])


# --- progress -------------------------------------------------------------------------------


def test_progress_is_periodic_lines_on_stderr_off_a_terminal_and_quiet_silences_it(tmp_path):
    p = _ckpt(tmp_path)
    r = cli("verify", str(p))
    assert r.returncode == 0 and r.stdout.startswith("ok: 3 tensors") and len(r.stdout.splitlines()) == 1
    lines = r.stderr.strip().splitlines()
    assert lines and all(line.startswith("unickpt verify: ") and "GB/s" in line for line in lines), lines
    assert lines[-1].startswith("unickpt verify: 100% ")
    r = cli("reshard", str(p), str(tmp_path / "re"), "--json")
    assert r.returncode == 0 and "unickpt reshard: 100% " in r.stderr and _json(r)["ok"]
    for argv in (["verify", str(p), "-q"], ["reshard", str(p), str(tmp_path / "re2"), "--quiet"],
                 ["-q", "verify", str(p)], ["--quiet", "reshard", str(p), str(tmp_path / "re3")]):  # either side
        r = cli(*argv)
        assert r.returncode == 0 and r.stderr == "", r.stderr
    for argv in (["verify", str(p), "-q", "--storage-options", "{}"], ["--storage-options", "{}", "-q", "verify", str(p)]):
        r = cli(*argv)  # storage options either side too (a local path takes none)
        assert r.returncode == 0 and r.stderr == "", r.stderr
    r = cli("--json", "-q", "verify", str(p))
    assert r.returncode == 0 and r.stderr == "" and _json(r)["ok"]
    r = cli("verify", str(p), "--jso")  # no abbreviations: main answers in JSON only for --json itself
    assert r.returncode == 2 and "unrecognized arguments: --jso" in r.stderr and r.stdout == ""
    r = cli("--json", "reshard", str(p), str(tmp_path / "re4"), "--drop-optimizer", "--zstd", "99")
    assert r.returncode == 2 and _json(r)["warnings"] == ["--drop-optimizer is deprecated; use --drop-role optimizer"]


def test_progress_is_a_tqdm_bar_on_a_terminal(monkeypatch, capsys):
    from unickpt import cli

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    prog = cli._Progress("verify", quiet=False)
    prog(10, 100)
    assert type(prog.bar).__module__.startswith("tqdm") and prog.bar.n == 10
    prog(100, 100)
    assert prog.bar.n == 100
    prog.close()
    assert cli._Progress("verify", quiet=True).tty is False


# --- reshard --drop-role, export --config, py.typed -----------------------------------------


def _roles_ckpt(tmp_path):
    sd = {"model": {"w": torch.randn(4, 4)}, "master": {"w": torch.randn(4, 4)},
          "optimizer": {"exp_avg": {"w": torch.randn(4, 4)}}, "ema": {"w": torch.randn(4, 4)},
          "trainer": {"step": 7}}
    unickpt.save(sd, tmp_path / "src", step=7)
    return tmp_path / "src"


def test_reshard_drops_several_roles(tmp_path):
    src = _roles_ckpt(tmp_path)
    r = cli("reshard", str(src), str(tmp_path / "dst"), "--drop-role", "optimizer", "--drop-role", "ema",
            "--drop-role", "trainer", "--json", "-q")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert _json(r)["dropped_roles"] == ["ema", "optimizer", "trainer"]
    _, man = unickpt.read_manifest(tmp_path / "dst")
    assert {role for role, _ in man.tensors} == {"model", "master"} and man.state == {}
    assert cli("verify", str(tmp_path / "dst"), "-q").returncode == 0


def test_reshard_lossless_is_bit_exact_smaller_and_verifies(tmp_path):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 256, generator=g) * 0.02
    sd = {"model": {"w": w.bfloat16()}, "master": {"w": w}, "optimizer": {"exp_avg": {"w": w * 1e-3}}}
    unickpt.save(sd, tmp_path / "src", step=3)
    r = cli("reshard", str(tmp_path / "src"), str(tmp_path / "dst"), "--lossless", "--json", "-q")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    out = _json(r)
    assert out["stored_bytes"] < out["bytes"] / 1.15
    assert cli("verify", str(tmp_path / "dst"), "-q").returncode == 0
    assert "lossless (byte-grouped)" in cli("inspect", str(tmp_path / "dst")).stdout
    files = _json(cli("inspect", str(tmp_path / "dst"), "--json"))["files"]
    assert all(f["frames"].get("byte-grouped", 0) >= 1 for f in files.values()), files
    t = {"model": {"w": torch.zeros(256, 256, dtype=torch.bfloat16)}, "master": {"w": torch.zeros(256, 256)},
         "optimizer": {"exp_avg": {"w": torch.zeros(256, 256)}}}
    unickpt.load(t, tmp_path / "dst")
    assert torch.equal(t["model"]["w"].view(torch.int16), sd["model"]["w"].view(torch.int16))
    assert torch.equal(t["master"]["w"].view(torch.int32), w.view(torch.int32))
    assert torch.equal(t["optimizer"]["exp_avg"]["w"].view(torch.int32), sd["optimizer"]["exp_avg"]["w"].view(torch.int32))
    line = _one_line(cli("reshard", str(tmp_path / "src"), str(tmp_path / "dst2"), "--lossless", "--zstd", "3"))
    assert "replaces zstd" in line and not (tmp_path / "dst2").exists()


def test_reshard_refuses_an_unknown_role_naming_the_roles_it_has(tmp_path):
    src = _roles_ckpt(tmp_path)
    line = _one_line(cli("reshard", str(src), str(tmp_path / "dst"), "--drop-role", "optimiser"))
    assert "'optimiser'" in line and "ema, master, model, optimizer, trainer" in line
    assert not (tmp_path / "dst").exists()
    line = _one_line(cli("reshard", str(src), str(tmp_path / "dst"), *sum((["--drop-role", x] for x in
                                                                          ("model", "master", "optimizer", "ema")), [])))
    assert "would leave no tensors" in line


def test_drop_optimizer_is_a_deprecated_alias(tmp_path):
    src = _roles_ckpt(tmp_path)
    r = cli("reshard", str(src), str(tmp_path / "dst"), "--drop-optimizer", "-q", "--json")
    assert r.returncode == 0
    assert r.stderr.strip() == "unickpt reshard: warning: --drop-optimizer is deprecated; use --drop-role optimizer"
    assert _json(r)["warnings"] == ["--drop-optimizer is deprecated; use --drop-role optimizer"]
    _, man = unickpt.read_manifest(tmp_path / "dst")
    assert "optimizer" not in {role for role, _ in man.tensors} and man.state == {"trainer": {"step": 7}}


def test_export_writes_the_config_given(tmp_path):
    p = _ckpt(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    r = cli("export", str(p), str(tmp_path / "hf"), "--config", str(tmp_path / "config.json"), "-q", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "llama"


def test_the_package_is_typed():
    from importlib.resources import files

    assert files("unickpt").joinpath("py.typed").is_file()


def test_python_dash_m_unickpt_is_the_command_line(tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "unickpt", "inspect", str(tmp_path / "none")], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "CheckpointNotFoundError" in r.stderr and "Traceback" not in r.stderr, r.stderr
