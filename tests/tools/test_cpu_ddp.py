"""CPU data parallelism: the launcher fails loudly (a failed rank stops the others, the launcher exits
non-zero), and moment matching's batch statistics are all-reduced across gloo ranks."""
import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from helpers import ROOT

from fairseq_linattn.modules.moment_matcher import MomentMatcher
from linattn_tools import cpu_ddp


def python(code: str):
    return [sys.executable, "-c", textwrap.dedent(code)]


def sleeper(pid_file: Path, ignore_sigterm: bool = False, grandchild: bool = False):
    """A rank that hangs (as in a collective whose peer died); writes its pid (and its child's) first."""
    return python(f"""
        import os, signal, subprocess, time
        if {ignore_sigterm}:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        pids = [os.getpid()]
        if {grandchild}:
            pids.append(subprocess.Popen(["sleep", "60"]).pid)
        tmp = {str(pid_file)!r} + ".tmp"
        open(tmp, "w").write(" ".join(map(str, pids)))
        os.replace(tmp, {str(pid_file)!r})
        time.sleep(60)
    """)


def failing(pid_file: Path, how: str):
    """A rank that waits until the sleeper runs, then exits 3 or kills itself with SIGKILL."""
    end = "os.kill(os.getpid(), signal.SIGKILL)" if how == "sigkill" else "raise SystemExit(3)"
    return python(f"""
        import os, signal, time
        deadline = time.time() + 10
        while not os.path.exists({str(pid_file)!r}) and time.time() < deadline:
            time.sleep(0.02)
        {end}
    """)


def gone(pid: int) -> bool:
    """The process has exited (no such pid, or a zombie nobody has reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_gone(pid: int, timeout: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout
    while not gone(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    return gone(pid)


def start(commands):
    return [subprocess.Popen(cmd, start_new_session=True) for cmd in commands]


@pytest.mark.parametrize("how, status", [("sigkill", 128 + signal.SIGKILL), ("exit3", 3)])
def test_a_failed_rank_stops_the_hanging_rank_and_gives_a_non_zero_status(tmp_path, how, status):
    pid_file = tmp_path / "pid"
    # rank 0 ends fine, rank 1 fails, rank 2 hangs: waiting in rank order would never see rank 1
    procs = start([python("pass"), failing(pid_file, how), sleeper(pid_file)])
    log = io.StringIO()
    t0 = time.monotonic()
    code = cpu_ddp.wait_ranks(procs, grace=5.0, log=log)
    elapsed = time.monotonic() - t0
    assert code == status and elapsed < 10, (code, elapsed)  # far below the sleeper's 60 s
    assert procs[2].returncode == -signal.SIGTERM  # stopped by the launcher, not left sleeping
    expected = "rank 1 was killed by SIGKILL" if how == "sigkill" else "rank 1 exited with status 3"
    assert expected in log.getvalue() and log.getvalue().count("\n") == 1


def test_a_rank_ignoring_sigterm_is_killed_after_the_grace_period_with_its_children(tmp_path):
    pid_file = tmp_path / "pid"
    procs = start([sleeper(pid_file, ignore_sigterm=True, grandchild=True), failing(pid_file, "exit3")])
    t0 = time.monotonic()
    code = cpu_ddp.wait_ranks(procs, grace=0.5, log=io.StringIO())
    elapsed = time.monotonic() - t0
    assert code == 3 and 0.5 <= elapsed < 10, (code, elapsed)
    assert procs[0].returncode == -signal.SIGKILL
    grandchild = int(pid_file.read_text().split()[1])
    assert wait_gone(grandchild)  # the whole process group went, not only the rank


def test_all_ranks_succeeding_gives_zero_only_after_the_last_one(tmp_path):
    procs = start([python("pass"), python("import time; time.sleep(0.5)")])
    t0 = time.monotonic()
    assert cpu_ddp.wait_ranks(procs, log=io.StringIO()) == 0
    assert time.monotonic() - t0 >= 0.4 and all(p.returncode == 0 for p in procs)


@pytest.mark.parametrize("code, status", [(-9, 137), (-15, 143), (0, 0), (3, 3), (1, 1)])
def test_exit_status_is_what_a_shell_reports(code, status):
    assert cpu_ddp.exit_status(code) == status


def rank_script(tmp_path: Path) -> Path:
    """A stand-in for fairseq-train: rank 1 exits 3 once rank 0 has written its pid; rank 0 hangs."""
    script = tmp_path / "fake_train.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys, time
        rank = int(sys.argv[sys.argv.index("--distributed-rank") + 1])
        assert sys.argv[1:3] == ["DATA", "--task"] and "--distributed-no-spawn" in sys.argv, sys.argv
        pid_file = os.path.join({str(tmp_path)!r}, f"rank{{rank}}.pid")
        open(pid_file + ".tmp", "w").write(str(os.getpid()))
        os.replace(pid_file + ".tmp", pid_file)
        if rank == 1 and os.environ.get("FAKE_FAIL") == "1":
            while not os.path.exists(os.path.join({str(tmp_path)!r}, "rank0.pid")):
                time.sleep(0.02)
            sys.exit(3)
        time.sleep(60)
    """))
    return script


def launcher(tmp_path: Path, fail: bool):
    cmd = [sys.executable, "-m", "linattn_tools.cpu_ddp", "--nproc", "2", "--train-command",
           f"{sys.executable} {rank_script(tmp_path)}", "--", "DATA", "--task", "x"]
    env = {**os.environ, "FAKE_FAIL": "1" if fail else "0",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    # SIGINT back to its default, so the launcher gets Ctrl-C even when the tests run in the background
    return subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


@pytest.mark.extended  # ~10 s: the launcher process imports fairseq
def test_launcher_command_exits_with_the_failed_rank_status(tmp_path):
    t0 = time.monotonic()
    proc = launcher(tmp_path, fail=True)
    _, err = proc.communicate(timeout=60)
    # well before rank 0's 60 s sleep ends (the launcher's own start, importing fairseq, takes a few s)
    assert proc.returncode == 3 and time.monotonic() - t0 < 30, (proc.returncode, err)
    assert "cpu_ddp: rank 1 exited with status 3" in err
    assert wait_gone(int((tmp_path / "rank0.pid").read_text()))


@pytest.mark.extended
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_interrupting_the_launcher_stops_every_rank(tmp_path, sig):
    proc = launcher(tmp_path, fail=False)
    pids = [tmp_path / f"rank{r}.pid" for r in range(2)]
    deadline = time.monotonic() + 10
    while not all(p.exists() for p in pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(sig)  # Ctrl-C in a terminal; the ranks run in their own sessions and get no SIGINT
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + sig, err
    assert all(wait_gone(int(p.read_text())) for p in pids)



# one gloo rank: alpha, beta of batch statistics after one training forward on its shard, and of EMA
# statistics after that forward is folded in; with rank 1 taking part, or inside statistics_left_out (as on a
# fairseq dummy batch)
GLOO_RANK = """
import contextlib, json, sys
import torch, torch.distributed as dist
from fairseq_linattn.modules.moment_matcher import MomentMatcher, statistics_left_out

rank, port, data = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=rank)
q, k, mask = torch.load(data)[rank]
out = {}
for left_out in (False, True):
    for stats in ("batch", "ema"):
        m = MomentMatcher(head_dim=4, num_heads=2, per_head=True, stats=stats, ema_momentum=0.5).train()
        with statistics_left_out() if left_out and rank == 1 else contextlib.nullcontext():
            m(q, k, mask)
        if stats == "ema":
            m(q, k, mask)  # uses the buffers the first forward folded its statistics into
        out[f"{left_out} {stats}"] = [m.last_alpha.tolist(), m.last_beta.tolist()]
print(json.dumps(out), flush=True)
dist.barrier()  # neither rank tears gloo down while the other still talks to it
dist.destroy_process_group()
"""


def one_process(q, k, mask):
    """GLOO_RANK's values computed in this process on one batch."""
    out = {}
    for stats in ("batch", "ema"):
        m = MomentMatcher(head_dim=4, num_heads=2, per_head=True, stats=stats, ema_momentum=0.5).train()
        m(q, k, mask)
        if stats == "ema":
            m(q, k, mask)
        out[stats] = [m.last_alpha.tolist(), m.last_beta.tolist()]
    return out


def shard(gen, scale):
    q = scale * torch.randn(3, 2, 9, 4, generator=gen, dtype=torch.float64)
    k = 2 * scale * torch.randn(3, 2, 9, 4, generator=gen, dtype=torch.float64) + 0.5
    mask = torch.zeros(3, 9, dtype=torch.bool)
    mask[1, 6:] = True
    mask[2, :4] = True
    return q, k, mask


def test_moment_matching_statistics_are_all_reduced_across_gloo_ranks(tmp_path, gen):
    shards = [shard(gen, 1.0), shard(gen, 3.0)]  # different scales: a rank's own statistics would show
    torch.save(shards, tmp_path / "shards.pt")
    script = tmp_path / "rank.py"
    script.write_text(GLOO_RANK)
    port = str(cpu_ddp.free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, str(script), str(r), port, str(tmp_path / "shards.pt")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for r in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    rank0, rank1 = (json.loads(out) for out, _ in outs)
    assert rank0 == rank1  # the same all-reduced sums on both ranks
    # one process on the whole global batch, or on rank 0's shard alone when rank 1 adds nothing
    whole = one_process(*(torch.cat(parts) for parts in zip(*shards)))
    alone = one_process(*shards[0])
    assert whole != alone  # the shards' statistics differ
    for left_out, expected in ((False, whole), (True, alone)):
        for stats in ("batch", "ema"):
            torch.testing.assert_close(torch.tensor(rank0[f"{left_out} {stats}"]), torch.tensor(expected[stats]),
                                       rtol=1e-10, atol=0, msg=f"left_out={left_out} stats={stats}")


def test_a_forward_left_out_of_the_statistics_folds_nothing_into_the_ema(gen):
    from fairseq_linattn.modules.moment_matcher import statistics_left_out

    q, k, mask = shard(gen, 3.0)
    ema = MomentMatcher(head_dim=4, num_heads=2, per_head=True, stats="ema", ema_momentum=0.5).train()
    batch = MomentMatcher(head_dim=4, num_heads=2, per_head=True, stats="batch").train()
    ema(q, k, mask)  # buffers away from their initial 1
    buffers = ema.ema_var_q.clone(), ema.ema_var_k.clone()
    with statistics_left_out():  # every rank on a dummy batch: no token anywhere
        ema(2 * q, 2 * k, mask)
        alpha, beta = batch(q, k, mask)
    assert torch.equal(ema.ema_var_q, buffers[0]) and torch.equal(ema.ema_var_k, buffers[1])
    assert bool(torch.isfinite(alpha).all() and torch.isfinite(beta).all())
    ema(2 * q, 2 * k, mask)  # outside: folded in again
    assert not torch.equal(ema.ema_var_q, buffers[0])


def test_ranks_run_with_glibc_keeping_freed_memory(tmp_path):
    script = tmp_path / "env_rank.py"
    script.write_text("import os, sys\n"
                      "rank = sys.argv[sys.argv.index('--distributed-rank') + 1]\n"
                      f"open({str(tmp_path)!r} + f'/rank{{rank}}.env', 'w').write("
                      "os.environ.get('MALLOC_MMAP_THRESHOLD_', '') + ' ' + "
                      "os.environ.get('MALLOC_TRIM_THRESHOLD_', ''))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.update(MALLOC_TRIM_THRESHOLD_="4096",  # the user's own setting is kept
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "linattn_tools.cpu_ddp", "--nproc", "2", "--train-command",
                           f"{sys.executable} {script}", "--", "DATA"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    for rank in (0, 1):
        assert (tmp_path / f"rank{rank}.env").read_text() == f"{2 ** 40} 4096"


def test_by_default_each_rank_runs_fairseq_train_through_ddp_rank(monkeypatch):
    launched = []
    monkeypatch.setattr(cpu_ddp, "launch", lambda commands, env, grace: launched.extend(commands) or 0)
    assert cpu_ddp.main(["--nproc", "2", "--", "DATA", "--task", "x"]) == 0
    assert [cmd[:3] for cmd in launched] == [[sys.executable, "-m", "linattn_tools.ddp_rank"]] * 2
    assert [cmd[cmd.index("--distributed-rank") + 1] for cmd in launched] == ["0", "1"]


def test_a_rank_leaves_its_gloo_group_once_training_returns_and_not_after_an_error(tmp_path):
    """ddp_rank.run destroys the default group after cli_main returns (gloo's threads otherwise meet interpreter
    finalisation: SIGABRT now and then), and keeps it when cli_main raises (a peer may wait in a collective)."""
    proc = subprocess.run(python(f"""
        import torch, torch.distributed as dist
        from linattn_tools.ddp_rank import run
        dist.init_process_group("gloo", init_method="file://{tmp_path / 'store'}", rank=0, world_size=1)

        def train():
            dist.all_reduce(torch.ones(3))
            return 7

        def fail():
            raise RuntimeError("diverged")

        assert run(train) == 7
        print("after return", dist.is_initialized())
        dist.init_process_group("gloo", init_method="file://{tmp_path / 'store2'}", rank=0, world_size=1)
        try:
            run(fail)
        except RuntimeError:
            print("after error", dist.is_initialized())
        dist.destroy_process_group()
    """), capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split("\n")[:2] == ["after return False", "after error True"]
