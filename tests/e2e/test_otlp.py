"""A recovery's trace reaches an OpenTelemetry collector over OTLP/HTTP, configured the standard way.

The test starts a minimal OTLP/HTTP receiver on a free loopback port, runs a job whose
worker is SIGKILLed once (the script never calls ``stead.report_step``: steps are
detected from its optimizer), with ``--trace otlp`` and only OpenTelemetry's own
variables (endpoint, protocol, service name), and checks the spans that arrive.
"""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.e2e

trace_service_pb2 = pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")

TRAIN = """
import os, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
model = torch.nn.Linear(2, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(40):
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    opt.zero_grad()
    if step == 5 and dist.get_rank() == 1 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        os.kill(os.getpid(), 9)
    time.sleep(0.02)
dist.destroy_process_group()
"""


class _Receiver(http.server.BaseHTTPRequestHandler):
    bodies: list[bytes]

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.path == "/v1/traces":
            self.bodies.append(body)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()
        self.wfile.write(trace_service_pb2.ExportTraceServiceResponse().SerializeToString())

    def log_message(self, *args: Any) -> None:
        return


@pytest.fixture
def receiver() -> Iterator[tuple[str, list[bytes]]]:
    bodies: list[bytes] = []
    handler = type("Handler", (_Receiver,), {"bodies": bodies})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", bodies
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_a_recovery_trace_arrives_at_an_otlp_http_collector(receiver: tuple[str, list[bytes]],
                                                            tmp_path: Path) -> None:
    endpoint, bodies = receiver
    (tmp_path / "train.py").write_text(textwrap.dedent(TRAIN))
    env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
           "OTEL_SERVICE_NAME": "my-training"}
    env.pop("OTEL_TRACES_EXPORTER", None)
    job = subprocess.run([sys.executable, "-m", "stead", "run", "--trace", "otlp", "--nproc-per-node", "2",
                          "--max-restarts", "1", "--job-name", "traced", "train.py"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert job.returncode == 0, job.stderr[-4000:]
    spans: dict[str, Any] = {}
    services = set()
    for body in bodies:
        request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
        for resource_spans in request.resource_spans:
            services |= {a.value.string_value for a in resource_spans.resource.attributes if a.key == "service.name"}
            for scope in resource_spans.scope_spans:
                spans.update({s.name: s for s in scope.spans})
    assert services == {"my-training"}
    assert set(spans) == {"recovery", "detect", "decide", "restart", "rendezvous", "first_step"}
    root = spans["recovery"]
    attributes = {a.key: a.value for a in root.attributes}
    assert attributes["stead.outcome"].string_value == "recovered"
    assert attributes["stead.signal"].int_value == 9 and "stead.exit_code" not in attributes
    assert all(s.trace_id == root.trace_id for s in spans.values())
    detect, first = spans["detect"], spans["first_step"]
    assert detect.end_time_unix_nano > detect.start_time_unix_nano  # from the agent seeing the worker die
    assert root.end_time_unix_nano == first.end_time_unix_nano  # the first step, detected without report_step
