"""SGLang through the smg servicer as smg-grpc-servicer 0.14.1 ships it (what
`python -m sglang.launch_server --grpc-mode` runs), with only the engine core
replaced, for the shipped-server process tests (shipped_servers.rs).

What runs is the servicer's own `serve_grpc`: its grpc.aio server with its
options, its health servicer and SGLang servicer, its warm-up thread marking
the health SERVING, its scheduler watchdog, and its shutdown (NOT_SERVING,
then `server.stop(5)`). What stands in: the scheduler (a child process that
only sleeps: killing it is the scheduler dying), the request manager (the
engine core's queue: Generate yields a few fixed tokens), the server
arguments and model config, and what engine_stand_ins.py stands in for.

Usage: python sglang_smg_server.py PORT WARMUP_SECONDS
The scheduler's pid is printed as `scheduler pid <n>`. SIGTERM is the
servicer's own shutdown. SIGUSR1 stalls the scheduler: a request pending and
nothing received from the scheduler for 31 s, past the servicer's own 30 s
stall threshold.
"""

import asyncio
import multiprocessing
import os
import signal
import sys
import time

# One log for the test: stdout goes where stderr goes.
os.dup2(2, 1)
sys.stdout = sys.stderr

from engine_stand_ins import Fields  # noqa: E402  (installs the stand-ins: before any SGLang import)

import logging  # noqa: E402

import msgspec  # noqa: E402
import smg_grpc_servicer.sglang.server as smg_server  # noqa: E402
import smg_grpc_servicer.sglang.servicer as smg_servicer  # noqa: E402

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

port = int(sys.argv[1])
warmup = float(sys.argv[2]) if len(sys.argv) > 2 else 1.0


class ServerArgs(msgspec.Struct, dict=True):
    """SGLang's ServerArgs (a msgspec Struct since 0.5.20): the arguments an
    operator gave, None for every other."""

    model_path: str = "/models/shipped-sglang"
    served_model_name: str = "shipped-sglang"
    tokenizer_path: str = "/models/shipped-sglang"
    host: str = "127.0.0.1"
    port: int = 0
    context_length: int | None = None
    skip_server_warmup: bool = True
    # The router sends token ids (SGLang's --skip-tokenizer-init).
    skip_tokenizer_init: bool = True
    is_embedding: bool = False

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return None


def _sleep_forever():
    while True:
        time.sleep(3600)


class RequestManager:
    """The engine core's side of the servicer: what GrpcRequestManager offers it."""

    def __init__(self):
        self.gracefully_exit = False
        self.last_receive_tstamp = time.time()
        self.rid_to_state = {}

    def auto_create_handle_loop(self):
        pass

    async def generate_request(self, obj, request_id=None, grpc_context=None):
        params = obj.sampling_params or {}
        if isinstance(params, dict):
            count = params.get("max_new_tokens") or 4
        else:
            count = getattr(params, "max_new_tokens", None) or 4
        for i in range(count):
            await asyncio.sleep(0.01)
            self.last_receive_tstamp = time.time()
            last = i == count - 1
            yield {
                "token_ids": [1000 + i],
                "index": 0,
                "finished": last,
                "meta_info": {
                    "id": request_id,
                    "prompt_tokens": 3,
                    "completion_tokens": i + 1,
                    "finish_reason": {"type": "length"} if last else None,
                },
            }

    def get_server_info(self):
        return {"active_requests": 0, "paused": False, "last_receive_time": 0.0}

    async def get_loads(self, include=None, dp_rank=None):
        return []

    async def abort_request(self, *args, **kwargs):
        return None

    def _cleanup_request_state(self, *args, **kwargs):
        pass

    async def shutdown(self):
        pass


# What SGLang's scheduler reports at its handshake (Scheduler.get_init_info).
scheduler_info = {
    "status": "ready",
    "max_total_num_tokens": 65536,
    "max_req_input_len": 4090,
}


async def launch_stand_in_scheduler(server_args, bootstrap_server=None):
    scheduler = multiprocessing.Process(target=_sleep_forever, daemon=True)
    scheduler.start()
    print(f"scheduler pid {scheduler.pid}", flush=True)
    return scheduler_info, None, [scheduler], RequestManager()


class _ConfigView:
    """EngineConfigView's answers for this stand-in model."""

    def __init__(self, *args, **kwargs):
        self.model = Fields(
            id2label=None, num_labels=0, model_type="llama", architectures=["LlamaForCausalLM"]
        )
        self.server_args = Fields(attention_dp_width=1)


_wait_and_warmup = smg_server._wait_and_warmup_grpc


def warm_up_then_serve(server_args, health_servicer=None):
    # The engine's warm-up, as long as asked; then the servicer's own step
    # that marks the health SERVING.
    time.sleep(warmup)
    # Said before the health turns SERVING, so a client that saw SERVING finds it said.
    print("warmed up", flush=True)
    _wait_and_warmup(server_args, health_servicer)


class _Published(dict):
    """SGLang's published config: every namespace there, nothing set in it."""

    def __contains__(self, name):
        return True

    def __missing__(self, name):
        return Fields()


import sglang.srt.runtime_context as runtime_context  # noqa: E402

runtime_context._CONTEXT._config_bags = _Published(serving=Fields())
smg_server.publish = lambda *args, **kwargs: None
smg_server._launch_scheduler_with_request_manager = launch_stand_in_scheduler
class ModelConfig:
    """SGLang's ModelConfig for the stand-in model: nothing set beyond its length."""

    context_len = 4096

    @classmethod
    def from_server_args(cls, server_args):
        return cls()

    def get_default_sampling_params(self):
        return {}

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return None


smg_server.ModelConfig = ModelConfig
smg_server.EngineConfigView = _ConfigView
smg_servicer.EngineConfigView = _ConfigView
smg_server._wait_and_warmup_grpc = warm_up_then_serve

managers = []
_make_request_manager = RequestManager


def _kept_request_manager():
    manager = _make_request_manager()
    managers.append(manager)
    return manager


RequestManager = _kept_request_manager


def _stall(*_):
    # What a stuck scheduler leaves behind: a request waiting on it, and
    # nothing received from it since 31 s ago.
    for manager in managers:
        manager.rid_to_state["stalled"] = object()
        manager.last_receive_tstamp = time.time() - 31
    print("scheduler stalled", flush=True)


signal.signal(signal.SIGUSR1, _stall)
asyncio.run(smg_server.serve_grpc(ServerArgs(port=port)))
print("servicer exited", flush=True)
