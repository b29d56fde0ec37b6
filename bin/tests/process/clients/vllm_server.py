"""vLLM 0.34.0's own gRPC launcher (`vllm.entrypoints.launchers.grpc_server`,
what `vllm serve --grpc` runs) with smg-grpc-servicer 0.14.1's servicer, as they
ship on PyPI, with only the engine replaced, for the shipped-server process
tests (shipped_servers.rs).

What runs is the launcher's own `serve_grpc` (behind the servicer's launcher
switch): its grpc.aio server with its options and in-flight counter, the smg
VllmEngineServicer and VllmHealthServicer (whose health is the engine's
`check_health()`), and its shutdown (NOT_SERVING, then `server.stop`). What
stands in: AsyncLLM (the engine: Generate yields a few fixed tokens as vLLM's
own RequestOutput), its engine arguments and config, and what
engine_stand_ins.py stands in for.

Usage: python vllm_server.py PORT
Signals: SIGUSR1 -> the engine core dies (AsyncLLM.errored, check_health
raises, as vLLM's EngineDeadError); SIGTERM -> the launcher's own shutdown.
"""

import argparse
import asyncio
import os
import signal
import sys

# One log for the test: stdout goes where stderr goes.
os.dup2(2, 1)
sys.stdout = sys.stderr

import engine_stand_ins  # noqa: E402  (before any vLLM import)

# Structured-output compilers (native, GPU-built): not used by these tests.
engine_stand_ins.stand_in("xgrammar", "llguidance", "tvm_ffi")

port = int(sys.argv[1])
Given = engine_stand_ins.Fields


class EngineDead(RuntimeError):
    """vLLM's EngineDeadError: the engine core process died."""


class AsyncLLM:
    """vLLM's AsyncLLM, as the servicer and the launcher use it."""

    def __init__(self, vllm_config):
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.errored = False
        self.renderer = Given(process_for_engine=lambda prompt, *args, **kwargs: prompt)

    @classmethod
    def from_vllm_config(cls, vllm_config, **kwargs):
        return cls(vllm_config)

    async def check_health(self):
        if self.errored:
            raise EngineDead("EngineCore encountered an issue")

    async def generate(self, prompt, sampling_params, request_id, *args, **kwargs):
        from vllm.outputs import CompletionOutput, RequestOutput

        count = getattr(sampling_params, "max_tokens", None) or 4
        tokens = []
        for i in range(count):
            await asyncio.sleep(0.01)
            tokens.append(1000 + i)
            last = i == count - 1
            yield RequestOutput(
                request_id=request_id,
                prompt=None,
                prompt_token_ids=[1, 2, 3],
                prompt_logprobs=None,
                outputs=[
                    CompletionOutput(
                        index=0,
                        text="",
                        token_ids=[1000 + i],
                        cumulative_logprob=None,
                        logprobs=None,
                        finish_reason="length" if last else None,
                    )
                ],
                finished=last,
            )

    async def abort(self, *args, **kwargs):
        pass

    def get_num_unfinished_requests(self):
        return 0

    def shutdown(self, timeout=None):
        pass

    async def do_log_stats(self):
        pass


class AsyncEngineArgs:
    """vLLM's engine arguments, reduced to the config the stand-in engine has."""

    @classmethod
    def from_cli_args(cls, args):
        return cls()

    def create_engine_config(self, usage_context=None):
        model_config = Given(
            model="/models/shipped-vllm",
            served_model_name="shipped-vllm",
            tokenizer="/models/shipped-vllm",
            max_model_len=4096,
            runner_type="generate",
            dtype="bfloat16",
            get_vocab_size=lambda: 32000,
            get_diff_sampling_param=lambda: {},
            hf_config=Given(model_type="llama", eos_token_id=2, bos_token_id=1, pad_token_id=0),
        )
        return Given(
            model_config=model_config,
            parallel_config=Given(data_parallel_size=1),
            scheduler_config=Given(max_num_seqs=256),
            shutdown_timeout=0,
        )


engine_stand_ins.lenient("vllm.engine.arg_utils", AsyncEngineArgs=AsyncEngineArgs)
engine_stand_ins.lenient("vllm.v1.engine.async_llm", AsyncLLM=AsyncLLM)
engine_stand_ins.lenient("vllm.entrypoints.common.startup")
engine_stand_ins.lenient("vllm.usage.usage_lib")
engine_stand_ins.lenient("vllm.utils.torch_utils")

import vllm.entrypoints.launchers.grpc_server as launcher  # noqa: E402

engines = []
_from_vllm_config = AsyncLLM.from_vllm_config


def _kept(vllm_config, **kwargs):
    engine = _from_vllm_config(vllm_config, **kwargs)
    engines.append(engine)
    return engine


AsyncLLM.from_vllm_config = staticmethod(_kept)


def _engine_core_dies(*_):
    for engine in engines:
        engine.errored = True
    print("engine core dead", flush=True)


signal.signal(signal.SIGUSR1, _engine_core_dies)


class Args(argparse.Namespace):
    """The launcher's parsed arguments: these, None for any other."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return None


asyncio.run(
    launcher.serve_grpc(
        Args(
            model="/models/shipped-vllm",
            host="127.0.0.1",
            port=port,
            enable_log_requests=False,
            disable_log_stats=True,
        )
    )
)
print("launcher exited", flush=True)
