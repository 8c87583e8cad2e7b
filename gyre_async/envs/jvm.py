"""One JVM per simulator jar, shared by every environment instance in the process.

ScienceWorld and TextWorldExpress are Java simulators driven over py4j. Their Python
classes start one JVM per environment object (~0.3-1 s and ~150 MB each), which does not
scale to a sampler running 32 environments on a small machine. Both jars expose a
``PythonInterface`` class whose instances are independent simulators, so one gateway can
serve many of them: :func:`new_interface` creates one per environment, on a JVM started on
first use and stopped when this process exits (py4j's ``die_on_exit``).

py4j opens one connection per calling thread, so environments stepped concurrently from
worker threads (``asyncio.to_thread``) run concurrently inside the JVM.
"""

from __future__ import annotations

import atexit
import os
import threading
from typing import Any

_gateways: dict[str, Any] = {}
_lock = threading.Lock()


def gateway(jar_path: str, javaopts: tuple[str, ...] = ()) -> Any:
    """The process-wide py4j gateway for ``jar_path`` (started on first call).

    The JVM runs in the jar's folder: the simulators read data files next to their jar.
    """
    with _lock:
        gw = _gateways.get(jar_path)
        if gw is not None:
            return gw
        from py4j.java_gateway import (
            CallbackServerParameters,
            GatewayParameters,
            JavaGateway,
            launch_gateway,
        )

        port, proc = launch_gateway(classpath=jar_path, die_on_exit=True,
                                    cwd=os.path.dirname(jar_path),
                                    javaopts=list(javaopts), return_proc=True)
        gw = JavaGateway(gateway_parameters=GatewayParameters(auto_field=True, port=port),
                         callback_server_parameters=CallbackServerParameters(port=0,
                                                                             daemonize=True),
                         java_process=proc)
        _gateways[jar_path] = gw
        return gw


def new_interface(jar_path: str, java_class: str, javaopts: tuple[str, ...] = ()) -> Any:
    """A fresh simulator object ``java_class`` (dotted name) in the shared JVM."""
    jvm = gateway(jar_path, javaopts).jvm
    target = jvm
    for part in java_class.split("."):
        target = getattr(target, part)
    return target()


@atexit.register
def shutdown() -> None:
    """Stop every JVM this process started (also happens when the process dies)."""
    with _lock:
        for gw in _gateways.values():
            try:
                gw.shutdown()
            except Exception:  # noqa: BLE001 - best effort at exit
                pass
        _gateways.clear()
