"""``gyre launch`` (one process per role, restarts) and the per-actor Prometheus endpoint.

The launcher is tested through real processes: a crash-looping child (restart budget and
backoff), the echo role on the embedded bus (SIGKILL -> restart -> SIGTERM stops all), and
the four core roles on Tansu, where the learner is SIGKILLed mid-run and the run must go on
publishing policy versions from the restarted learner. Tansu, not noida-db, because
noida-db never expires a member that died without leaving its group.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import structlog

from actors.echo import EchoActor
from gyre_async.bus import open_bus
from gyre_async.bus.reading import read_events
from gyre_async.runtime.actor import ActorRunner
from gyre_async.runtime.launcher import (
    Launcher,
    Role,
    backoff_s,
    describe_exit,
    read_status,
    wait_until,
)
from gyre_async.runtime.metrics import (
    actor_metrics,
    render,
    serve_actor_metrics,
    start_metrics_server,
)
from schemas import encode, event_id
from schemas.config import EchoConfig
from schemas.events import PolicyVersion, Probe
from schemas.topics import POLICY_VERSION, PROBE_IN

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "ops" / "configs" / "tiny.toml"
SAMPLE = re.compile(
    r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)$')


# -- helpers ---------------------------------------------------------------------------------

def parse_prometheus(text: str) -> tuple[dict[str, float], dict[str, str]]:
    """Samples (``name{labels}`` -> value) and ``# TYPE`` per family; fails on a bad line."""
    samples, types = {}, {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            types[name] = kind
            continue
        match = SAMPLE.match(line)
        assert match, f"not a Prometheus sample line: {line!r}"
        key = match["name"] + (f"{{{match['labels']}}}" if match["labels"] else "")
        samples[key] = float(match["value"])
    return samples, types


def write_config(tmp_path: Path, run_id: str) -> Path:
    text = TINY.read_text().replace('run_dir = "runs/tiny"', f'run_dir = "{tmp_path / "run"}"')
    text = text.replace('run_id = "tiny"', f'run_id = "{run_id}"')
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(text.replace("max_versions = 4", "max_versions = 0"))
    return cfg


def launch(tmp_path: Path, cfg: Path, bus: str, *extra: str) -> tuple[subprocess.Popen, Path]:
    status = tmp_path / "status.json"
    with open(tmp_path / "launcher.log", "w") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen(
            [sys.executable, "-m", "gyre_async.cli", "launch", str(cfg), "--bus", bus,
             "--status-file", str(status), *extra],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    return proc, status


def wait_for(what: str, predicate, timeout: float, log: Path, every: float = 0.5):
    try:
        return wait_until(what, predicate, timeout, every)
    except TimeoutError as exc:
        raise AssertionError(f"{exc}:\n{log.read_text()[-4000:]}") from None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def stop_launcher(proc: subprocess.Popen, log: Path, timeout: float = 60) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"launcher ignored SIGTERM:\n{log.read_text()[-4000:]}") from None


def latest_checkpoint_version(run_dir: Path) -> int:
    names = [p.name for p in (run_dir / "checkpoints").glob("v*.safetensors")]
    return max((int(n[1:13]) for n in names), default=-1)


# -- launcher: restart policy ----------------------------------------------------------------

def test_backoff_and_exit_descriptions():
    assert [backoff_s(n) for n in (1, 2, 3, 4, 5, 6, 50)] == [0.5, 1, 2, 4, 8, 10, 10]
    assert describe_exit(-9) == "SIGKILL" and describe_exit(3) == "exit 3"


def test_crash_looping_role_exhausts_restarts_and_launcher_fails(tmp_path, capsys):
    role = Role("crasher", [sys.executable, "-c", "import sys; sys.exit(3)"])
    done = Role("oneshot", [sys.executable, "-c", "pass"])
    status = tmp_path / "status.json"
    with structlog.testing.capture_logs() as logs:
        code = Launcher([role, done], max_restarts=2, stop_timeout=5,
                        status_file=str(status)).run()
    assert code == 1
    restarts = [e for e in logs if e["event"] == "launcher.restart"]
    assert [(e["role"], e["exit"], e["restart"], e["backoff_s"]) for e in restarts] == [
        ("crasher", "exit 3", 1, 0.5), ("crasher", "exit 3", 2, 1.0)]
    assert any(e["event"] == "launcher.gave_up" and e["role"] == "crasher" for e in logs)
    err = capsys.readouterr().err
    assert "crasher (pid" in err and "died with exit 3; restart 1/2 in 0.5 s" in err
    assert "restart limit 2 reached" in err
    final = json.loads(status.read_text())
    assert final["stopped"] and final["failed_role"] == "crasher"
    crasher = final["roles"]["crasher"]
    assert crasher["restarts"] == 3 and len(crasher["pids"]) == 3
    assert final["roles"]["oneshot"]["done"] and final["roles"]["oneshot"]["restarts"] == 0


def test_launcher_restarts_killed_echo_and_stops_on_sigterm(tmp_path):
    cfg = tmp_path / "echo.toml"
    cfg.write_text(f'[run]\nrun_id = "launch-echo"\nrun_dir = "{tmp_path / "run"}"\n')
    proc, status = launch(tmp_path, cfg, f"sqlite:///{tmp_path}/events.db", "--roles", "echo",
                          "--max-restarts", "3")
    log = tmp_path / "launcher.log"
    try:
        first = wait_for("echo started", lambda: read_status(status).get("roles", {})
                         .get("echo", {}).get("pid"), 30, log)
        time.sleep(1.0)  # let it reach the consume loop (not required: any death restarts)
        os.kill(first, signal.SIGKILL)
        echo = wait_for("echo restarted", lambda: (s := read_status(status)["roles"]["echo"])
                        ["restarts"] == 1 and s["alive"] and s["pid"] != first and s, 30, log)
        assert echo["last_exit"] == "SIGKILL"
    finally:
        code = stop_launcher(proc, log)
    assert code == 0, log.read_text()[-3000:]
    final = read_status(status)
    assert final["stopped"] and not any(pid_alive(p) for p in final["roles"]["echo"]["pids"])
    text = log.read_text()
    assert f"echo (pid {first}) died with SIGKILL; restart 1/3" in text
    restart = [json.loads(line) for line in text.splitlines()
               if line.startswith("{") and "launcher.restart" in line]
    assert restart and restart[0]["role"] == "echo" and restart[0]["exit"] == "SIGKILL"


@pytest.mark.slow
@pytest.mark.kafka
def test_launcher_runs_core_roles_and_survives_sigkill_on_tansu(tmp_path, tansu, unique):
    run_id = f"launch-{unique}"
    cfg = write_config(tmp_path, run_id)
    run_dir = tmp_path / "run"
    url = f"kafka://{tansu}"
    proc, status = launch(tmp_path, cfg, url, "--max-restarts", "3", "--stop-timeout", "30")
    log = tmp_path / "launcher.log"
    try:
        roles = wait_for("four roles", lambda: len(read_status(status).get("roles", {})) == 4
                         and read_status(status)["roles"], 30, log)
        pids = {r: s["pid"] for r, s in roles.items()}
        assert len(set(pids.values())) == 4 and os.getpid() not in pids.values()
        wait_for(">= 2 policy versions", lambda: latest_checkpoint_version(run_dir) >= 1,
                 120, log, every=1)
        assert proc.poll() is None
        os.kill(pids["learner"], signal.SIGKILL)
        killed_at = latest_checkpoint_version(run_dir)  # nothing after this is the old learner's
        learner = wait_for("learner restarted", lambda: (s := read_status(status)["roles"]
                           ["learner"])["restarts"] == 1 and s["alive"] and s, 30, log)
        assert learner["pid"] != pids["learner"] and learner["last_exit"] == "SIGKILL"
        # wait for the event, not the file: a checkpoint is written before it is announced
        wait_for("a policy version from the restarted learner",
                 lambda: max(asyncio.run(published_versions(url, run_id)), default=-1)
                 > killed_at, 150, log, every=2)
        others = read_status(status)["roles"]
        assert all(others[r]["restarts"] == 0 and others[r]["alive"]
                   for r in ("sampler", "segmenter", "arbiter")), others
    finally:
        code = stop_launcher(proc, log)
    assert code == 0, log.read_text()[-3000:]
    final = read_status(status)
    every_pid = [p for s in final["roles"].values() for p in s["pids"]]
    assert len(every_pid) == 5 and not any(pid_alive(p) for p in every_pid)
    assert "learner (pid" in log.read_text() and "died with SIGKILL" in log.read_text()
    versions = asyncio.run(published_versions(url, run_id))
    assert versions == list(range(len(versions))) and versions[-1] > killed_at, versions


async def published_versions(url: str, run_id: str) -> list[int]:
    async with open_bus(url) as bus:
        events = [e async for _, e in read_events(bus, [POLICY_VERSION], on_bad="raise")]
    return sorted({e.version for e in events if isinstance(e, PolicyVersion)
                   and e.run_id == run_id})


# -- topic provisioning ----------------------------------------------------------------------

def test_provision_topics_help_and_plan():
    script = str(ROOT / "ops" / "provision_topics.py")
    help_text = subprocess.run([sys.executable, script, "--help"], capture_output=True,
                               text=True, check=True).stdout
    assert "--bus" in help_text and "--keep-policy-history" in help_text
    out = subprocess.run([sys.executable, script, "--plan", "--config", str(TINY),
                          "--partitions", "6"], capture_output=True, text=True, check=True)
    plan = {t["name"]: t for t in json.loads(out.stdout)}
    assert plan[POLICY_VERSION]["partitions"] == 1
    assert plan[POLICY_VERSION]["configs"]["cleanup.policy"] == "compact"
    assert plan["trajectory-step"]["partitions"] == 6
    assert plan["trajectory-step"]["configs"]["retention.ms"] == str(72 * 3_600_000)


@pytest.mark.kafka
def test_provision_topics_checks_each_error_code_on_noida(noida, unique, capsys):
    """noida-db, unlike Tansu, refuses an impossible replication factor: the per-topic
    error code must turn into exit status 1 (aiokafka's create_topics does not raise)."""
    sys.path.insert(0, str(ROOT / "ops"))
    from types import SimpleNamespace

    from aiokafka.admin import AIOKafkaAdminClient
    from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
    from provision_topics import plan_topics, provision

    args = SimpleNamespace(partitions=2, replication_factor=1, max_message_bytes=1_000_000,
                           steps_retention_hours=1, retention_days=2, policy_history_days=1,
                           keep_policy_history=False)
    plan = [{**t, "name": f"{unique}.{t['name']}"} for t in plan_topics(args)]
    assert asyncio.run(provision(plan, noida, {}, dry_run=False, timeout_ms=10_000)) == 0
    assert capsys.readouterr().out.count("created") == len(plan)
    assert asyncio.run(provision(plan, noida, {}, dry_run=False, timeout_ms=10_000)) == 0
    assert capsys.readouterr().out.count("exists") == len(plan)
    bad = [{**t, "name": t["name"] + ".rf3", "replication_factor": 3} for t in plan[:2]]
    assert asyncio.run(provision(bad, noida, {}, dry_run=False, timeout_ms=10_000)) == 1
    assert "InvalidReplicationFactorError" in capsys.readouterr().err

    async def policy_config():
        admin = AIOKafkaAdminClient(bootstrap_servers=noida)
        await admin.start()
        try:
            [response] = await admin.describe_configs(
                [ConfigResource(ConfigResourceType.TOPIC, f"{unique}.{POLICY_VERSION}")])
            return {e[0]: e[1] for e in response.resources[0][4]}
        finally:
            await admin.close()

    assert asyncio.run(policy_config())["cleanup.policy"] == "compact"


# -- Prometheus endpoint ---------------------------------------------------------------------

class StatEcho(EchoActor):
    """Echo with stats like the learner's and a name that needs sanitising."""

    def stats(self):
        return {"charts/max_staleness_seen": 2.0, "losses/approx_kl": 0.015,
                "odd name-x": 3.0}


def test_render_sanitises_names_and_escapes_labels():
    text = render({"charts/a b": 1, 'gyre_x{k="v\\"q",j="2"}': 2.5, "n": float("nan"),
                   "gyre_c_total": 4, "skip": "not a number"})
    samples, types = parse_prometheus(text)
    assert samples["gyre_charts_a_b"] == 1.0 and samples["gyre_c_total"] == 4.0
    assert 'gyre_x{k="v\\"q",j="2"} 2.5' in text and "gyre_n NaN" in text
    assert types["gyre_c_total"] == "counter" and types["gyre_charts_a_b"] == "gauge"
    assert "skip" not in text


async def test_metrics_endpoint_matches_runner(tmp_path):
    url = f"sqlite:///{tmp_path}/events.db"
    async with open_bus(url) as bus:
        await bus.create_topics([PROBE_IN], 2)
        probes = [Probe(event_id=event_id("probe", "m", i), run_id="m", producer="test",
                        key=f"k{i}", seq=i, payload="boom" if i == 3 else "p") for i in range(4)]
        await bus.publish(PROBE_IN, [(p.key.encode(), encode(p)) for p in probes])
        runner = ActorRunner(StatEcho(EchoConfig(fail_on_payload="boom")), bus, run_id="m",
                             group="m.echo", heartbeat_s=60)
        task = asyncio.create_task(runner.run())
        server = serve_actor_metrics(runner, 0, host="127.0.0.1")
        base = f"http://127.0.0.1:{server.port}"
        try:
            for _ in range(100):
                if runner.processed == 3 and runner.dead_letters == 1 \
                        and await bus.lag("m.echo", [PROBE_IN]) == 0:
                    break
                await asyncio.sleep(0.1)
            response = await asyncio.to_thread(urllib.request.urlopen, f"{base}/metrics", None, 10)
            text = response.read().decode()
            assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            health = await asyncio.to_thread(urllib.request.urlopen, f"{base}/healthz", None, 10)
            assert health.status == 200
            with pytest.raises(urllib.error.HTTPError):
                await asyncio.to_thread(urllib.request.urlopen, f"{base}/nope", None, 10)
            direct = actor_metrics(runner)
        finally:
            server.stop()
            runner.stop()
            await task
    samples, types = parse_prometheus(text)
    assert all(k.startswith("gyre_") for k in samples)
    assert samples["gyre_processed_total"] == 3.0 == runner.processed
    assert samples["gyre_dead_letters_total"] == 1.0 and samples["gyre_duplicates_total"] == 0.0
    assert samples["gyre_bus_lag"] == 0.0 and samples["gyre_up"] == 1.0
    assert samples["gyre_charts_max_staleness_seen"] == 2.0
    assert samples["gyre_losses_approx_kl"] == 0.015
    assert samples["gyre_echo_odd_name_x"] == 3.0
    assert samples['gyre_busy_seconds{category="codec"}'] > 0
    assert samples['gyre_busy_seconds{category="bus"}'] > 0
    assert types["gyre_busy_seconds"] == "counter" and types["gyre_bus_lag"] == "gauge"
    assert types["gyre_processed_total"] == "counter"
    assert 0 <= samples["gyre_framework_share"] <= 1
    assert "gyre_bus_lag" not in direct and direct["gyre_processed_total"] == 3.0


def test_metrics_server_reports_collect_errors():
    def broken():
        raise RuntimeError("no")

    server = start_metrics_server(0, broken, host="127.0.0.1")
    try:
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10)
        assert info.value.code == 500
    finally:
        server.stop()


def test_gyre_actor_metrics_port_serves_prometheus(tmp_path):
    from brokers import free_port

    port = free_port()
    cfg = tmp_path / "echo.toml"
    cfg.write_text(f'[run]\nrun_id = "metrics"\nrun_dir = "{tmp_path / "run"}"\n')
    with open(tmp_path / "echo.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "gyre_async.cli", "actor", "echo",
                                 "--config", str(cfg), "--bus", f"sqlite:///{tmp_path}/events.db",
                                 "--metrics-port", str(port)], cwd=ROOT, stdout=log, stderr=log)
    try:
        def scrape():
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    return r.read().decode()
            except OSError:
                return None

        text = wait_for("metrics endpoint", scrape, 30, tmp_path / "echo.log")
        samples, _ = parse_prometheus(text)
        assert samples["gyre_up"] == 1.0 and samples["gyre_processed_total"] == 0.0
        assert samples["gyre_bus_lag"] == 0.0
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


# -- replicas ----------------------------------------------------------------------------------

def test_replicas_expand_into_named_processes_with_replica_flags():
    from types import SimpleNamespace

    from gyre_async.runtime.launcher import parse_replicas, role_argv

    roles = ["sampler", "segmenter", "arbiter", "learner", "keeper"]
    assert parse_replicas("sampler=4", roles) == {"sampler": 4, "segmenter": 1, "arbiter": 1,
                                                  "learner": 1, "keeper": 1}
    assert parse_replicas("", roles) == dict.fromkeys(roles, 1)
    # a data-parallel learner runs as replicas (ranks), segmenters and arbiters split
    # partitions; the keeper and evaluator hold the run's judgement and do not
    assert parse_replicas("learner=2", roles)["learner"] == 2
    assert parse_replicas("segmenter=2,arbiter=3", roles) == {
        "sampler": 1, "segmenter": 2, "arbiter": 3, "learner": 1, "keeper": 1}
    for bad in ("sampler=0", "sampler=x", "echo=2", "keeper=2"):
        with pytest.raises(ValueError):
            parse_replicas(bad, roles)
    args = SimpleNamespace(config="c.toml", bus="kafka://b:9092", run_dir=None, log_level=None)
    argv = role_argv("sampler", args, 9100, (2, 4))
    assert argv[3:] == ["actor", "sampler", "--config", "c.toml", "--replica", "2/4",
                        "--bus", "kafka://b:9092", "--metrics-port", "9100"]


def test_gyre_actor_replica_sets_the_sampler_section_and_the_name(tiny):
    from types import SimpleNamespace

    from gyre_async.cli.actor import replica_config as _replica
    from gyre_async.errors import ConfigError

    cfg = tiny.config()
    out, name = _replica(SimpleNamespace(role="sampler", replica="2/4", name=None), cfg)
    assert (out.sampler.replica, out.sampler.replicas, name) == (2, 4, "sampler-2")
    out, name = _replica(SimpleNamespace(role="sampler", replica="0/2", name="east-0"), cfg)
    assert (out.sampler.replica, out.sampler.replicas, name) == (0, 2, "east-0")
    out, name = _replica(SimpleNamespace(role="sampler", replica=None, name=None), cfg)
    assert (out.sampler.replica, out.sampler.replicas, name) == (0, 1, None)
    for bad in ("4/4", "-1/2", "1", "a/b"):
        with pytest.raises(ConfigError):
            _replica(SimpleNamespace(role="sampler", replica=bad, name=None), cfg)


def test_launcher_runs_echo_replicas_as_separate_processes(tmp_path):
    cfg = tmp_path / "echo.toml"
    cfg.write_text(f'[run]\nrun_id = "launch-replicas"\nrun_dir = "{tmp_path / "run"}"\n')
    proc, status = launch(tmp_path, cfg, f"sqlite:///{tmp_path}/events.db", "--roles", "echo",
                          "--replicas", "echo=2")
    log = tmp_path / "launcher.log"
    try:
        roles = wait_for("two echo replicas", lambda: (r := read_status(status).get("roles", {}))
                         and all(s["alive"] for s in r.values()) and r, 30, log)
        assert sorted(roles) == ["echo-0", "echo-1"]
        assert roles["echo-0"]["pid"] != roles["echo-1"]["pid"]
    finally:
        code = stop_launcher(proc, log)
    assert code == 0, log.read_text()[-3000:]
