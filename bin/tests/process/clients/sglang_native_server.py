"""SGLang's native gRPC server as SGLang 0.5.23 ships it, with only its engine
core replaced, for the shipped-server process tests (shipped_servers.rs).

What runs is SGLang's own code from the PyPI wheel: the Rust server
(`sglang/srt/rust_extensions/_grpc*.so`, started with `start_server` as
`http_server._start_native_grpc_server_for_runtime` starts it) and its Python
bridge `sglang.srt.entrypoints.grpc_bridge.RuntimeHandle`. What stands in:
the TokenizerManager (the engine core: its state fields and their change
callback behave as SGLang's do; Generate yields a few fixed tokens), the
server arguments, and what engine_stand_ins.py stands in for.

Usage: python sglang_native_server.py PORT WARMUP_SECONDS
Signals: SIGUSR1 -> the scheduler fails (server_status UnHealthy);
SIGUSR2 -> generation paused / continued (is_pause toggled);
SIGTERM -> SGLang's SIGTERM: gracefully_exit at once (unhealthy), calls
drain for up to 5 s, then the gRPC server shuts down and the process exits.
"""

import asyncio
import importlib.util
import os
import signal
import sys
import threading
import time
import types

# The test reads one log: stdout (this script's lines, and the Rust server's,
# which tracing writes to fd 1) goes where stderr goes.
os.dup2(2, 1)
sys.stdout = sys.stderr

from engine_stand_ins import Fields  # noqa: E402  (installs the stand-ins: before any SGLang import)

import sglang  # noqa: E402
import sglang.srt.runtime_context as runtime_context  # noqa: E402
from sglang.srt.entrypoints.grpc_bridge import RuntimeHandle  # noqa: E402

# ---- the stand-in engine core ----------------------------------------------------

port = int(sys.argv[1])
warmup = float(sys.argv[2]) if len(sys.argv) > 2 else 1.0


class ServerArgs(Fields):
    def resolved_dict(self):
        return {
            "model_path": "/models/shipped-sglang",
            "served_model_name": "shipped-sglang",
            "context_length": 4096,
            "tp_size": 1,
        }


server_args = ServerArgs(
    model_path="/models/shipped-sglang",
    tokenizer_path="/models/shipped-sglang",
    launch_command=f"python -m sglang.launch_server --grpc-port {port}",
)
runtime_context._CONTEXT._config_bags = {
    "serving": Fields(
        host="127.0.0.1",
        grpc_port=port,
        tokenizer_path="/models/shipped-sglang",
        grpc_worker_threads=2,
        grpc_response_timeout_secs=30,
    )
}


class TokenizerManager:
    """The engine state SGLang's TokenizerManager keeps, with its change callback:
    every change of server_status, gracefully_exit or is_pause calls it, which
    is what makes the Rust server publish a new WatchEngineState message."""

    def __init__(self):
        self.server_args = server_args
        self.model_path = "/models/shipped-sglang"
        self.served_model_name = "shipped-sglang"
        self.is_generation = True
        self.model_config = types.SimpleNamespace(
            context_len=4096,
            hf_config=types.SimpleNamespace(
                model_type="llama", architectures=["LlamaForCausalLM"]
            ),
        )
        self.mm_processor = None
        self.event_loop = None
        self.in_flight = 0
        self._callback = None
        self._server_status = "Starting"
        self._gracefully_exit = False
        self._is_pause = False

    def auto_create_handle_loop(self):
        self.event_loop = asyncio.new_event_loop()
        threading.Thread(target=self.event_loop.run_forever, daemon=True).start()

    def set_engine_state_changed_callback(self, callback):
        self._callback = callback

    def set(self, field, value):
        if getattr(self, field) == value:
            return
        setattr(self, field, value)
        if self._callback is not None:
            self._callback()

    def is_healthy(self):
        return not self._gracefully_exit and self._server_status == "Up"

    @property
    def is_pause(self):
        return self._is_pause

    def config_value(self, key):
        return None

    async def generate_request(self, obj, request=None):
        self.in_flight += 1
        try:
            count = (obj.sampling_params or {}).get("max_new_tokens") or 4
            for i in range(count):
                await asyncio.sleep(0.01)
                yield {
                    "output_ids": [1000 + i],
                    "meta_info": {
                        "id": obj.rid,
                        "prompt_tokens": len(obj.input_ids or []),
                        "completion_tokens": i + 1,
                        "finish_reason": {"type": "length"} if i == count - 1 else None,
                    },
                }
        finally:
            self.in_flight -= 1

    async def get_loads(self, dp_rank=None):
        return []


# ---- SGLang's own server -----------------------------------------------------------

extension = os.path.join(
    os.path.dirname(sglang.__file__),
    "srt",
    "rust_extensions",
    "_grpc.cpython-311-x86_64-linux-gnu.so",
)
spec = importlib.util.spec_from_file_location("sglang.srt.rust_extensions._grpc", extension)
grpc_native = importlib.util.module_from_spec(spec)
spec.loader.exec_module(grpc_native)

manager = TokenizerManager()
handle = RuntimeHandle(
    tokenizer_manager=manager,
    template_manager=None,
    server_args=server_args,
    # What SGLang's scheduler reports at its handshake (Scheduler.get_init_info).
    scheduler_info={
        "status": "ready",
        "max_total_num_tokens": 65536,
        "max_req_input_len": 4090,
    },
)
server = grpc_native.start_server(
    host="127.0.0.1",
    port=port,
    runtime_handle=handle,
    worker_threads=2,
    response_timeout_secs=30,
)
print(f"listening {port}", flush=True)


def warm_up():
    time.sleep(warmup)
    # Said before the status turns Up, so a client that saw Up finds it said.
    print("warmed up", flush=True)
    manager.set("_server_status", "Up")


threading.Thread(target=warm_up, daemon=True).start()

stop = threading.Event()


def on_term(*_):
    manager.set("_gracefully_exit", True)
    print("SIGTERM: draining", flush=True)

    def drain():
        deadline = time.monotonic() + 5
        while manager.in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        stop.set()

    threading.Thread(target=drain, daemon=True).start()


def on_usr1(*_):
    manager.set("_server_status", "UnHealthy")
    print("scheduler failed: UnHealthy", flush=True)


def on_usr2(*_):
    manager.set("_is_pause", not manager.is_pause)
    print(f"is_pause={manager.is_pause}", flush=True)


signal.signal(signal.SIGTERM, on_term)
signal.signal(signal.SIGUSR1, on_usr1)
signal.signal(signal.SIGUSR2, on_usr2)
while not stop.wait(0.1):
    pass
server.shutdown()
print("gRPC server shut down", flush=True)
