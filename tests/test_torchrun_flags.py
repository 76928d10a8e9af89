"""torchrun 2.13's flags: each means here what it means in torchrun, or is refused with one
line saying why and what to do. Never accepted and ignored.

The flag list comes from torch's own parser (``torch.distributed.run.get_args_parser``), so a
flag torch adds is a failing test here until it is handled."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_agent.supervision.config import (
    RUN_PATH_BOOTSTRAP,
    StaticPlacement,
    UsageError,
    build_parser,
    parse_args,
)
from tests.agents import AGENT, Agent, wait_until

ENV_SCRIPT = """\
import json, os, sys
keys = ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
        "CUDA_VISIBLE_DEVICES")
print("ENV " + json.dumps({k: os.environ.get(k) for k in keys}
                          | {"argv": sys.argv, "name": __name__}), flush=True)
"""


def torch_flags() -> set[str]:
    from torch.distributed.run import get_args_parser

    return {s for a in get_args_parser()._actions for s in a.option_strings}


def our_flags() -> set[str]:
    return {s for a in build_parser()._actions for s in a.option_strings}


def test_every_torchrun_flag_is_known_in_both_spellings() -> None:
    missing = torch_flags() - our_flags()
    assert not missing, f"torchrun flags elastic-agent does not know: {sorted(missing)}"


def test_the_pet_variables_are_torchruns() -> None:
    from torch.distributed.run import get_args_parser

    from elastic_agent.supervision.config import PET_SWITCHES, PET_VALUES

    kinds = {a.dest: type(a).__name__ for a in get_args_parser()._actions}
    assert set(PET_VALUES) == {d for d, k in kinds.items() if k == "env"}
    assert set(PET_SWITCHES) == {d for d, k in kinds.items() if k == "check_env"}


def test_pet_variables_give_defaults_the_command_line_wins(script: Path) -> None:
    env = {"PET_NPROC_PER_NODE": "3", "PET_MAX_RESTARTS": "5", "PET_STANDALONE": "1",
           "PET_ROLE": "pet"}
    cfg = parse_args([str(script)], environ=env)
    assert (cfg.nproc, cfg.max_restarts, cfg.standalone, cfg.role) == (3, 5, True, "pet")
    cfg = parse_args(["--nproc-per-node", "2", "--role", "cli", str(script)], environ=env)
    assert (cfg.nproc, cfg.role) == (2, "cli")
    assert "PET_STANDALONE='yes': a switch is 0 or 1" in usage(
        [str(script)], environ={"PET_STANDALONE": "yes"})
    assert "--nproc-per-node 'many'" in usage([str(script)], environ={"PET_NPROC_PER_NODE": "many"})


def test_an_unknown_logs_specs_is_one_line_naming_the_installed_ones(script: Path) -> None:
    line = usage(["--logs-specs", "mine", str(script)])
    assert "no torchrun.logs_specs entry point named 'mine'" in line, line
    assert "(installed: default" in line, line  # torch's own DefaultLogsSpecs


FILTER_SCRIPT = """\
import os, sys
r = os.environ["LOCAL_RANK"]
for i in range(3):
    print(f"loss {i} rank {r}")
    print(f"acc {i} rank {r}")
print(f"a,b together {r}")
print(f"warn loss on stderr {r}", file=sys.stderr)
"""


def filtered(root: Path, name: str) -> list[str]:
    (path,) = root.rglob(name)
    assert path.parent.name == "attempt_0", path
    return sorted(path.read_text().splitlines())


def test_duplicate_filters_write_the_same_filtered_files_as_torchrun(
        redis_url: str, job_id: str, tmp_path: Path) -> None:
    script = tmp_path / "filters.py"
    script.write_text(FILTER_SCRIPT)
    flags = ["--nproc-per-node", "2", "--tee", "3", "--duplicate-stdout-filters", "loss,a,,b",
             "--duplicate_stderr_filters", "warn"]
    ours, theirs = tmp_path / "ours", tmp_path / "torchrun"
    agent = Agent(["--redis", redis_url, "--job-id", job_id, *flags, "--log-dir", str(ours),
                   str(script)], tmp_path, "agent")
    assert agent.wait(60) == 0, agent.output
    torchrun = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", *flags, "--log-dir",
         str(theirs), str(script)], capture_output=True, text=True, timeout=120)
    assert torchrun.returncode == 0, torchrun.stderr
    for name in ("filtered_stdout.log", "filtered_stderr.log"):
        assert filtered(ours, name) == filtered(theirs, name), name
    assert filtered(ours, "filtered_stdout.log") == sorted(
        [f"[default{r}]:loss {i} rank {r}" for r in (0, 1) for i in range(3)]
        + [f"[default{r}]:a,b together {r}" for r in (0, 1)])


def envs(agent: Agent) -> list[dict]:
    return [json.loads(line[4:]) for line in agent.output.splitlines() if line.startswith("ENV ")]


@pytest.fixture()
def script(tmp_path: Path) -> Path:
    p = tmp_path / "env.py"
    p.write_text(ENV_SCRIPT)
    return p


def usage(argv: list[str], environ: dict[str, str] | None = None) -> str:
    with pytest.raises(UsageError) as info:
        parse_args(argv, environ=environ or {})
    message = str(info.value)
    assert "\n" not in message
    return message


# -- rendezvous -----------------------------------------------------------------------------

def test_rdzv_conf_maps_torchs_keys_or_refuses_them_by_name(script: Path) -> None:
    cfg = parse_args(["--rdzv-conf", "join_timeout=7,last_call_timeout=2,keep_alive_interval=1,"
                      "keep_alive_max_attempt=4", str(script)], environ={})
    s = cfg.rendezvous
    assert (s.join_timeout, s.last_call_timeout, s.keep_alive_interval, s.heartbeat_timeout) == (
        7, 2, 1, 4)
    for key in ("close_timeout", "read_timeout", "timeout", "is_host"):
        assert f"--rdzv-conf {key}: not used by elastic-agent" in usage(
            ["--rdzv-conf", f"{key}=1", str(script)])
    assert "unknown key" in usage(["--rdzv-conf", "bogus=1", str(script)])


def test_rdzv_backend_redis_static_or_refused(script: Path) -> None:
    assert parse_args([str(script)], environ={}).static is None
    assert parse_args(["--rdzv-backend", "redis", str(script)], environ={}).static is None
    assert "elastic-agent meets in Redis" in usage(["--rdzv-backend", "c10d", str(script)])
    # torchrun's default backend is static: --node-rank without a backend means static.
    cfg = parse_args(["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1",
                      "--job-id", "j", str(script)], environ={})
    assert cfg.static == StaticPlacement(1, "10.0.0.1", 29500)
    assert "only used with --rdzv-backend static" in usage(
        ["--rdzv-backend", "redis", "--master-port", "1234", str(script)])
    assert "needs a fixed --nnodes" in usage(
        ["--rdzv-backend", "static", "--nnodes", "1:2", "--job-id", "j", str(script)])
    assert "must be below --nnodes 2" in usage(
        ["--nnodes", "2", "--node-rank", "2", "--master-addr", "h", "--job-id", "j",
         str(script)])
    assert "needs --master-addr" in usage(
        ["--rdzv-backend", "static", "--nnodes", "2", "--node-rank", "1", "--job-id", "j",
         str(script)])


def test_static_rendezvous_gives_the_asked_ranks_and_master(redis_url: str, job_id: str,
                                                            script: Path, tmp_path: Path) -> None:
    common = ["--redis", redis_url, "--job-id", job_id, "--nnodes", "2", "--nproc-per-node",
              "2", "--master-addr", "127.0.0.1", "--master-port", "29777"]
    # Node rank 1 joins first: a dynamic rendezvous would make it group rank 0.
    one = Agent([*common, "--node-rank", "1", str(script)], tmp_path, "one")
    try:
        wait_until(lambda: "joining the rendezvous" in one.output, 30, "node 1 to join")
        zero = Agent([*common, "--node-rank", "0", str(script)], tmp_path, "zero")
        assert one.wait(60) == 0, one.output
        assert zero.wait(60) == 0, zero.output
    finally:
        one.kill()
    ranks = {e["RANK"]: e for e in envs(one) + envs(zero)}
    assert sorted(ranks) == ["0", "1", "2", "3"]
    assert {e["GROUP_RANK"] for e in envs(one)} == {"1"}
    assert {e["RANK"] for e in envs(one)} == {"2", "3"}
    assert {(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in ranks.values()} == {
        ("127.0.0.1", "29777")}


def test_static_rendezvous_refuses_a_taken_node_rank(redis_url: str, job_id: str,
                                                     script: Path, tmp_path: Path) -> None:
    common = ["--redis", redis_url, "--job-id", job_id, "--nnodes", "2", "--master-addr",
              "127.0.0.1", "--node-rank", "0", str(script)]
    a, b = (Agent(common, tmp_path, name) for name in ("a", "b"))
    try:
        wait_until(lambda: a.proc.poll() is not None or b.proc.poll() is not None, 60,
                   "the node that lost the rank to exit")
        loser, keeper = (a, b) if a.proc.poll() is not None else (b, a)
        assert loser.wait(10) == 1, loser.output
        assert "--node-rank 0 is taken by another node" in loser.output, loser.output
        # The holder waits for a node with rank 1, as a static job of 2 nodes must.
        wait_until(lambda: "waiting for 1 more" in keeper.output.rsplit("re-forming", 1)[-1],
                   30, "the holder to wait for the missing rank")
        assert keeper.proc.poll() is None
    finally:
        a.kill()
        b.kill()


# -- workers --------------------------------------------------------------------------------

def test_virtual_local_rank_gives_each_worker_its_gpu_as_device_0(redis_url: str, job_id: str,
                                                                   script: Path,
                                                                   tmp_path: Path) -> None:
    agent = Agent(["--redis", redis_url, "--job-id", job_id, "--nproc-per-node", "2",
                   "--virtual-local-rank", str(script)], tmp_path, "agent",
                  env={"CUDA_VISIBLE_DEVICES": "3,5"})
    assert agent.wait(60) == 0, agent.output
    seen = {(e["RANK"], e["LOCAL_RANK"], e["CUDA_VISIBLE_DEVICES"]) for e in envs(agent)}
    assert seen == {("0", "0", "3"), ("1", "0", "5")}
    assert "names 1 GPU(s)" in usage(["--nproc-per-node", "2", "--virtual-local-rank",
                                      str(script)], {"CUDA_VISIBLE_DEVICES": "0"})


def test_run_path_runs_the_script_as_torchrun_does(redis_url: str, job_id: str, script: Path,
                                                   tmp_path: Path) -> None:
    cfg = parse_args(["--run-path", "--no-python", str(script), "a", "b"], environ={})
    assert cfg.entrypoint[-4:] == [RUN_PATH_BOOTSTRAP, str(script), "a", "b"]  # wins over it
    agent = Agent(["--redis", redis_url, "--job-id", job_id, "--run-path", str(script), "x",
                   "--flag"], tmp_path, "agent")
    assert agent.wait(60) == 0, agent.output
    (e,) = envs(agent)
    assert e["argv"] == [str(script), "x", "--flag"] and e["name"] == "__main__"


def test_event_log_handler_console_prints_torch_shaped_events(redis_url: str, job_id: str,
                                                               script: Path,
                                                               tmp_path: Path) -> None:
    agent = Agent(["--redis", redis_url, "--job-id", job_id, "--event-log-handler", "console",
                   str(script)], tmp_path, "agent")
    assert agent.wait(60) == 0, agent.output
    events = [json.loads(line) for line in agent.output.splitlines()
              if line.startswith('{"name": "elastic_agent.')]
    names = [e["name"] for e in events]
    assert "elastic_agent.workers_started" in names and "elastic_agent.job_succeeded" in names
    assert all(e["source"] == "AGENT" and isinstance(e["timestamp"], int) for e in events)
    quiet = Agent(["--redis", redis_url, "--job-id", job_id + "-q", str(script)], tmp_path, "q")
    assert quiet.wait(60) == 0
    assert '"elastic_agent.' not in quiet.output  # null, torchrun's default
    assert "knows null, console, dynamic_rendezvous" in usage(
        ["--event-log-handler", "mine", str(script)])


def test_numa_binding_without_gpus_is_one_clear_refusal(script: Path) -> None:
    p = subprocess.run([*AGENT, "--numa-binding", "node", str(script)], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "no CUDA device is visible" in lines[0], p.stderr
