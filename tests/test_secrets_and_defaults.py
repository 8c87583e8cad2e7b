"""Secrets stay secret, and the operator defaults are the safe ones.

Secrets: a password in a bus URL never reaches the run directory (``config.json``, the
report, anything else), the logs, metrics labels, nor a command line that ``ps`` shows: a
launched role gets it through its environment. ``config.json`` is readable by its owner
only. A URL may name its secret as ``${VARIABLE}``, expanded only when the bus is built.

Defaults: metrics listen on loopback unless ``--metrics-host`` says otherwise; every size,
count and duration of the config is bounded, and a value out of bounds stops ``gyre run``
at start-up (exit 2, the field and the fix named); an unreachable Kafka bus ends ``gyre
run``/``gyre launch``/``gyre actor`` with one line and no traceback.

The claims about processes are checked on real processes (``gyre run``, ``gyre launch``,
``gyre actor``), on the embedded bus and on a noida-db broker.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from gyre_async.bus.secrets import REDACTED, expand_query, externalize, redact
from gyre_async.runtime.launcher import read_status, wait_until

ROOT = Path(__file__).resolve().parents[1]
SECRET = "S3CRET-pw-7f3a"
GYRE = [sys.executable, "-m", "gyre_async.cli"]


def kafka_url(bootstrap: str, password: str = SECRET) -> str:
    """A PLAINTEXT URL that carries SASL credentials: the fixture brokers have no SASL, and
    PLAINTEXT ignores them, so the run connects while the password still travels with it."""
    return f"kafka://{bootstrap}?sasl_plain_username=gyre&sasl_plain_password={password}"


def files_holding(root: Path, needle: str) -> list[str]:
    """Every file under ``root`` whose bytes contain ``needle`` (binary files included)."""
    found = []
    for path in root.rglob("*"):
        if path.is_file() and needle.encode() in path.read_bytes():
            found.append(str(path.relative_to(root)))
    return found


def gyre(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*GYRE, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


# -- secrets: the rules ------------------------------------------------------------------------

def test_redact_hides_every_form_of_a_bus_secret():
    url = ("kafka://h1:9092,h2:9092?security_protocol=SASL_SSL&sasl_mechanism=PLAIN"
           f"&sasl_plain_username=gyre&sasl_plain_password={SECRET}&ssl_password={SECRET}x")
    shown = redact(url)
    assert SECRET not in shown
    assert shown == url.replace(f"={SECRET}x", f"={REDACTED}").replace(f"={SECRET}", f"={REDACTED}")
    assert "sasl_plain_username=gyre" in shown  # only secrets go
    assert redact(json.dumps({"bus": {"url": url}})) == json.dumps({"bus": {"url": shown}})
    assert SECRET not in redact(f"error: cannot reach {url} (after 3 tries)")
    assert redact(f"kafka://gyre:{SECRET}@h:9092") == f"kafka://gyre:{REDACTED}@h:9092"
    assert SECRET not in redact(f"kafka://h:1?sasl_plain_password={SECRET}%26more")
    named = "kafka://h:1?sasl_plain_password=${GYRE_KAFKA_PASSWORD}"
    assert redact(named) == named  # a reference names the secret, it does not hold it
    assert redact("sqlite:///runs/q/events.db") == "sqlite:///runs/q/events.db"


def test_a_named_secret_is_expanded_only_when_the_bus_is_built(monkeypatch):
    from gyre_async.bus import BusURLError, open_bus

    named = ("kafka://127.0.0.1:1?security_protocol=SASL_PLAINTEXT&sasl_mechanism=PLAIN"
             "&sasl_plain_username=gyre&sasl_plain_password=${GYRE_TEST_PASSWORD}")
    monkeypatch.delenv("GYRE_TEST_PASSWORD", raising=False)
    with pytest.raises(BusURLError) as info:  # unset: named, never guessed
        open_bus(named)
    assert "GYRE_TEST_PASSWORD" in str(info.value)
    monkeypatch.setenv("GYRE_TEST_PASSWORD", SECRET)
    bus = open_bus(named)
    assert bus.connection_config()["sasl_plain_password"] == SECRET  # what the client gets
    assert SECRET not in repr(bus) and SECRET not in bus.url
    # a URL whose secret was redacted (a recorded config.json) refuses to connect, saying why
    with pytest.raises(BusURLError, match="redacted"):
        open_bus(redact(named.replace("${GYRE_TEST_PASSWORD}", SECRET)))
    # what a launched role receives: references in the URL, values in the environment
    url, env = externalize(named.replace("${GYRE_TEST_PASSWORD}", "p%26ss+word"))
    assert env == {"GYRE_BUS_SASL_PLAIN_PASSWORD": "p&ss word"}
    assert expand_query(url.split("?", 1)[1], env)["sasl_plain_password"] == "p&ss word"


def test_logs_and_metrics_labels_redact_secrets():
    import structlog

    from gyre_async.runtime.logs import configure_logging
    from gyre_async.runtime.metrics import render

    url = kafka_url("b:9092")
    stream = io.StringIO()
    configure_logging("DEBUG", stream=stream)
    handler = logging.StreamHandler(stream)  # pytest owns the root logger: wire one in
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        configure_logging("DEBUG", stream=stream)  # adds the redacting filter to it too
        log = structlog.get_logger("test")
        log.info(f"connecting to {url}", url=url, options={"url": url})
        try:
            raise ConnectionError(f"no broker at {url}")
        except ConnectionError:
            log.exception("bus.failed")
        logging.getLogger("aiokafka").warning("bootstrap from %s failed", url)
    finally:
        root.removeHandler(handler)
        structlog.reset_defaults()
    text = stream.getvalue()
    assert "bus.failed" in text and "bootstrap from" in text and "ConnectionError" in text
    assert SECRET not in text, [line for line in text.splitlines() if SECRET in line]
    page = render({f'gyre_bus_info{{url="{url}"}}': 1.0})
    assert SECRET not in page and REDACTED in page


# -- secrets: real runs ------------------------------------------------------------------------

@pytest.mark.slow  # an end-to-end run: the full tier (the fast tier stays under 3 minutes)
def test_gyre_run_leaves_no_secret_in_its_run_directory_and_keeps_config_private(tiny, tmp_path):
    """The run uses the embedded log (``--bus``); its config names a Kafka bus with a
    password, which is what ``config.json`` and the report would have shown."""
    run_dir = tmp_path / "run"
    cfg = tiny.write(bus={"url": kafka_url("kafka.invalid:9092")},
                     learner={"max_versions": 1}, evaluator={"every_versions": 1, "episodes": 2})
    done = gyre("--log-level", "INFO", "run", str(cfg), "--no-progress",
                "--bus", f"sqlite:///{run_dir}/events.db")
    assert done.returncode == 0, done.stderr[-3000:]
    report = gyre("report", str(run_dir))
    assert report.returncode == 0, report.stderr[-3000:]
    assert (run_dir / "config.json").exists() and (run_dir / "report.html").exists()
    assert files_holding(run_dir, SECRET) == []
    assert SECRET not in done.stdout + done.stderr + report.stdout + report.stderr
    mode = stat.S_IMODE((run_dir / "config.json").stat().st_mode)
    assert mode == 0o600, oct(mode)
    recorded = json.loads((run_dir / "config.json").read_text())
    assert recorded["bus"]["url"] == redact(kafka_url("kafka.invalid:9092"))
    # a config.json written before redaction existed is still shown redacted
    recorded["bus"]["url"] = kafka_url("kafka.invalid:9092")
    (run_dir / "config.json").write_text(json.dumps(recorded))
    assert gyre("report", str(run_dir)).returncode == 0
    assert SECRET not in (run_dir / "report.html").read_text()
    # the recorded config, reused as is, refuses its redacted secret in one clear line
    redacted = tmp_path / "recorded.json"
    redacted.write_text(json.dumps({**recorded, "bus": {
        **recorded["bus"], "url": redact(kafka_url("127.0.0.1:1"))}}))
    reuse = gyre("actor", "echo", "--config", str(redacted), timeout=60)
    assert reuse.returncode == 2 and "redacted" in reuse.stderr, reuse.stderr
    assert "Traceback" not in reuse.stderr


@pytest.mark.slow
@pytest.mark.kafka
def test_gyre_run_over_kafka_with_a_password_writes_it_nowhere(tiny, tmp_path, noida, unique):
    """A whole run on a broker, its config's bus URL holding the password."""
    run_dir = tmp_path / "run"
    url = kafka_url(noida)
    cfg = tiny.write(run={"run_id": f"secret-{unique}"}, bus={"url": url, "partitions": 2},
                     task={"env_config": {"n_orders": 1, "max_steps": 30}},
                     sampler={"num_envs": 4},
                     learner={"batch_steps": 64, "minibatch_steps": 32, "max_versions": 1},
                     evaluator={"every_versions": 1, "episodes": 2})
    done = gyre("--log-level", "INFO", "run", str(cfg), "--no-progress")
    assert done.returncode == 0, done.stderr[-3000:]
    report = gyre("report", str(run_dir), "--bus", url)  # the log lives on the broker
    assert report.returncode == 0, report.stderr[-3000:]
    assert files_holding(run_dir, SECRET) == []
    assert SECRET not in done.stdout + done.stderr + report.stdout + report.stderr
    assert stat.S_IMODE((run_dir / "config.json").stat().st_mode) == 0o600
    assert redact(url) in (run_dir / "report.html").read_text().replace("&amp;", "&")


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def _echo_answers(url: str, run_id: str) -> bool:
    """Publish a probe on the broker and wait for the launched echo's answer."""
    from gyre_async.bus import open_bus
    from gyre_async.bus.reading import read_topics
    from schemas import decode, encode, event_id
    from schemas.events import Probe
    from schemas.topics import PROBE_IN, PROBE_OUT

    async def ask() -> bool:
        probe = Probe(event_id=event_id("probe", run_id), run_id=run_id, producer="test",
                      key=run_id, seq=1, payload="ping")
        async with open_bus(url) as bus:
            await bus.publish(PROBE_IN, [(probe.key.encode(), encode(probe))])
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                for record in await read_topics(bus, [PROBE_OUT]):
                    answer = decode(PROBE_OUT, record.value)
                    if answer.run_id == run_id and answer.payload == "ping":
                        return True
                await asyncio.sleep(0.5)
        return False

    return asyncio.run(ask())


@pytest.mark.kafka
@pytest.mark.parametrize("form", ["literal", "named"])
def test_launched_roles_get_the_password_by_environment_not_argv(tmp_path, noida, unique, form):
    """``literal``: ``--bus`` holds the password; each role's command line names
    ``${GYRE_BUS_SASL_PLAIN_PASSWORD}`` and its environment holds the value. ``named``: the
    URL says ``${GYRE_KAFKA_PASSWORD}`` and no process's command line (the launcher's
    included) holds the password: ``ps`` shows it nowhere."""
    from gyre_async.bus import open_bus
    from schemas.topics import PROBE_IN, PROBE_OUT

    run_id = f"launch-secret-{unique}"
    cfg = tmp_path / "echo.toml"
    cfg.write_text(f'[run]\nrun_id = "{run_id}"\nrun_dir = "{tmp_path / "run"}"\n'
                   "[bus]\npartitions = 1\n")

    async def topics() -> None:
        async with open_bus(f"kafka://{noida}") as bus:
            await bus.create_topics([PROBE_IN, PROBE_OUT], 1)

    asyncio.run(topics())
    env = {"GYRE_KAFKA_PASSWORD": SECRET}
    bus = kafka_url(noida, SECRET if form == "literal" else "${GYRE_KAFKA_PASSWORD}")
    status, log = tmp_path / "status.json", tmp_path / "launcher.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([*GYRE, "launch", str(cfg), "--bus", bus, "--roles", "echo",
                                 "--status-file", str(status)], cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT, env={**os.environ, **env})
    try:
        pid = wait_until("echo started", lambda: read_status(status).get("roles", {})
                         .get("echo", {}).get("pid"), 60)
        assert _echo_answers(kafka_url(noida), run_id), log.read_text()[-3000:]
        child = _cmdline(pid)
        assert "--bus" in child and SECRET not in child, child
        environ = Path(f"/proc/{pid}/environ").read_bytes()
        if form == "literal":
            assert "sasl_plain_password=${GYRE_BUS_SASL_PLAIN_PASSWORD}" in child
            assert f"GYRE_BUS_SASL_PLAIN_PASSWORD={SECRET}".encode() in environ.split(b"\0")
            assert "--bus holds a password" in log.read_text()  # the launcher's own argv
        else:
            assert "sasl_plain_password=${GYRE_KAFKA_PASSWORD}" in child
            ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True)
            assert str(pid) in ps.stdout and str(proc.pid) in ps.stdout
            assert SECRET not in ps.stdout
    finally:
        proc.terminate()
        code = proc.wait(timeout=60)
    assert code == 0, log.read_text()[-3000:]
    assert SECRET not in log.read_text()


# -- operator defaults -------------------------------------------------------------------------

def test_eval_results_and_every_other_event_refuse_nan_and_inf_naming_the_field():
    """The schema-wide rule on one base (every float field of every event, however deep, is
    covered by tests/test_fuzz_decoders.py::test_one_broken_field_is_rejected_naming_it)."""
    from schemas import DecodeError, decode, encode
    from schemas.events import EvalResult, Heartbeat, PrimitiveStep, TrajectoryStep

    good = EvalResult(event_id="e", run_id="r", producer="evaluator", policy_version=1,
                      episodes=4, success_rate=0.5, mean_score=1.0, mean_length=9.0)
    raw = msgspec.to_builtins(good)
    for field, bad in (("success_rate", float("nan")), ("mean_score", float("inf")),
                       ("milestone_rates", {"key": float("-inf")}), ("ts", float("nan"))):
        with pytest.raises(DecodeError) as info:
            decode("eval", msgspec.msgpack.encode({**raw, field: bad}))
        assert f"{field}" in info.value.reason and "must be finite" in info.value.reason
    assert decode("eval", encode(good)) == good
    with pytest.raises(ValueError, match=r"stats\['lag_s'\] must be finite"):
        Heartbeat(event_id="h", run_id="r", producer="p", actor="a", role="echo",
                  processed=0, lag=0, in_flight=0, uptime_s=1.0, stats={"lag_s": float("inf")})
    with pytest.raises(ValueError, match=r"primitives\[0\].feedback must be finite"):
        TrajectoryStep(event_id="s", run_id="r", producer="p", trajectory_id="t", task_id="t",
                       step_index=0, policy_version=0, context_tokens=[1], action_tokens=[2],
                       action_logprobs=[-0.1],
                       primitives=[PrimitiveStep(action="go", feedback=float("nan"))])


async def test_a_heartbeat_leaves_out_a_stat_without_reading_and_caps_an_infinite_one(tmp_path):
    """Producers never emit NaN: a stat that is NaN is left out, an infinite one capped."""
    from actors.echo import EchoActor
    from gyre_async.bus import open_bus
    from gyre_async.bus.reading import read_topics
    from gyre_async.runtime.actor import ActorRunner
    from schemas import decode
    from schemas.config import EchoConfig
    from schemas.events import MAX_READING, Heartbeat
    from schemas.topics import PROBE_IN, TELEMETRY

    class Odd(EchoActor):
        def stats(self) -> dict[str, float]:
            return {"fine": 1.0, "none": float("nan"), "huge": float("inf")}

    async with open_bus(f"sqlite:///{tmp_path}/events.db") as bus:
        await bus.create_topics([PROBE_IN, TELEMETRY], 1)
        runner = ActorRunner(Odd(EchoConfig()), bus, run_id="hb", name="echo",
                             heartbeat_s=0.1, partitions=1)
        task = asyncio.create_task(runner.run())
        beats: list[Heartbeat] = []
        deadline = time.monotonic() + 30
        while not beats and time.monotonic() < deadline and not task.done():
            await asyncio.sleep(0.2)
            beats = [e for r in await read_topics(bus, [TELEMETRY])
                     if isinstance(e := decode(TELEMETRY, r.value), Heartbeat)]
        runner.stop()
        await task
    assert beats, "no heartbeat"
    assert beats[0].stats["fine"] == 1.0 and beats[0].stats["huge"] == MAX_READING
    assert "none" not in beats[0].stats


def _listening(port: int) -> set[str]:
    """Addresses (as /proc/net/tcp writes them) listening on ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, _, hex_port = local.rpartition(":")
            if int(hex_port, 16) == port and state == "0A":  # 0A: LISTEN
                found.add(address)
    return found


@pytest.mark.parametrize("host,address", [(None, "0100007F"), ("0.0.0.0", "00000000")])
def test_metrics_listen_on_loopback_unless_told_otherwise(tmp_path, host, address):
    sys.path.insert(0, str(ROOT / "ops"))
    from brokers import free_port

    port = free_port()
    cfg = tmp_path / "echo.toml"
    cfg.write_text(f'[run]\nrun_id = "metrics-host"\nrun_dir = "{tmp_path / "run"}"\n')
    extra = ["--metrics-host", host] if host else []
    with open(tmp_path / "echo.log", "w") as log:
        proc = subprocess.Popen([*GYRE, "actor", "echo", "--config", str(cfg), "--bus",
                                 f"sqlite:///{tmp_path}/events.db", "--metrics-port",
                                 str(port), *extra], cwd=ROOT, stdout=log, stderr=log)
    try:
        bound = wait_until("metrics endpoint", lambda: _listening(port), 60)
        assert bound == {address}, bound
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0


def _bounded_fields() -> list[tuple[str, float, float]]:
    """(path, a refused value, an accepted value) for every bounded field of the config."""
    from schemas.config import Config

    out = []

    def walk(cls, prefix: str) -> None:
        for f in msgspec.structs.fields(cls):
            t = f.type
            if isinstance(t, type) and issubclass(t, msgspec.Struct):
                walk(t, f"{prefix}{f.name}.")
                continue
            meta = getattr(t, "__metadata__", None)
            if not meta:
                continue
            m = meta[0]
            if m.ge is not None:
                out.append((prefix + f.name, m.ge - 1, m.ge))
            elif m.gt is not None:
                out.append((prefix + f.name, m.gt, m.gt + 1))

    walk(Config, "")
    return out


#: Number fields with no bound, and why: seeds, and weights/rates that may take any sign or
#: are checked across fields in gyre_async.config.validate.
UNBOUNDED_INTS = {"run.seed", "task.train_seed_start", "task.eval_seed_start",
                  "keeper.probe_seed_start"}


def test_every_integer_of_the_config_is_bounded_or_a_seed():
    from schemas.config import Config

    bounded = {path for path, _, _ in _bounded_fields()}
    plain = []

    def walk(cls, prefix: str) -> None:
        for f in msgspec.structs.fields(cls):
            if isinstance(f.type, type) and issubclass(f.type, msgspec.Struct):
                walk(f.type, f"{prefix}{f.name}.")
            elif f.type is int:
                plain.append(prefix + f.name)

    walk(Config, "")
    assert set(plain) == UNBOUNDED_INTS, sorted(set(plain) - UNBOUNDED_INTS)
    for path in ("learner.minibatch_steps", "learner.batch_steps", "sampler.num_envs",
                 "segmenter.max_segment_steps", "bus.partitions", "learner.learning_rate",
                 "sampler.step_timeout_s", "loop.max_wall_s", "elite.capacity"):
        assert path in bounded, path


@pytest.mark.parametrize("path,refused,accepted", _bounded_fields(),
                         ids=[p for p, _, _ in _bounded_fields()])
def test_each_bounded_field_refuses_out_of_bounds_naming_field_and_fix(tiny, path, refused,
                                                                       accepted):
    from gyre_async.config import load_config
    from gyre_async.errors import ConfigError

    section, *inner, name = path.split(".")

    def override(value) -> dict:
        table: dict = {name: value}
        for part in reversed(inner):
            table = {part: table}
        return {section: table}

    with pytest.raises(ConfigError) as info:
        load_config(tiny.write(**override(refused)))
    message = str(info.value)
    assert f"{path} = {refused!r}" in message and f"Fix: set {path} to" in message, message
    load_config(tiny.write(**override(accepted)))


def test_gyre_run_refuses_a_zero_minibatch_at_start_up(tiny, tmp_path):
    run_dir = tmp_path / "run"
    cfg = tiny.write(learner={"minibatch_steps": 0})
    started = time.monotonic()
    done = gyre("run", str(cfg), "--no-progress", timeout=120)
    assert done.returncode == 2, done.stderr
    assert time.monotonic() - started < 60
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert "learner.minibatch_steps = 0" in lines[0]
    assert "Fix: set learner.minibatch_steps to at least 1" in lines[0]
    assert not run_dir.exists()  # refused before anything was made
    launched = gyre("launch", str(cfg), timeout=120)
    assert launched.returncode == 2 and "learner.minibatch_steps = 0" in launched.stderr


@pytest.mark.parametrize("command", [["run", "{cfg}", "--no-progress"], ["launch", "{cfg}"],
                                     ["actor", "echo", "--config", "{cfg}"]])
def test_an_unreachable_kafka_bus_is_one_line_without_traceback(tiny, command):
    sys.path.insert(0, str(ROOT / "ops"))
    from brokers import free_port

    bootstrap = f"127.0.0.1:{free_port()}"
    cfg = tiny.write()
    args = [a.replace("{cfg}", str(cfg)) for a in command]
    done = gyre(*args, "--bus", f"kafka://{bootstrap}", timeout=120)
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("gyre: bus unreachable: cannot connect to Kafka at " + bootstrap)
    assert "check that the broker runs" in lines[0] and "Traceback" not in done.stderr


def test_logging_configured_under_a_swapped_stderr_keeps_working_after_it_closes(monkeypatch):
    """``configure_logging()`` without a stream writes to the stderr of the moment: a caller
    that swapped ``sys.stderr`` (a test's capture, an in-process CLI call) and closed it
    must not make every later log line fail with "I/O operation on closed file"."""
    import structlog

    from gyre_async.runtime.logs import configure_logging

    swapped = io.StringIO()
    monkeypatch.setattr(sys, "stderr", swapped)
    configure_logging("INFO")
    structlog.get_logger("t").info("first")
    assert "first" in swapped.getvalue()
    swapped.close()
    later = io.StringIO()
    monkeypatch.setattr(sys, "stderr", later)
    try:
        structlog.get_logger("t").info("second")
    finally:
        structlog.reset_defaults()
    assert "second" in later.getvalue()
