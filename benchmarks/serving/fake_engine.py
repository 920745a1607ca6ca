"""Fake engines for Redis cost measurements: the real engine worker (`EngineWorker`: request
stream intake, outbox flush with checkpoints and acks, heartbeats, takeovers, guards) around an
engine with no model, which gives every running request its next token each step and makes a
step last ``running / tok_s`` seconds, so each engine delivers `tok_s` tokens a second while busy.
Everything a fake engine writes to Redis goes through the worker's own code.

    python -m benchmarks.serving.fake_engine --redis-url redis://127.0.0.1:6379/0 --model-name bench \\
        --model-dir DIR --engines 4 --tok-s 2000

`--model-dir` is a model directory with a ``tokenizer.json`` (its tokenizer is what gateways load;
the fake tokens are the ids of a plain English sentence in it). SIGTERM drains every engine."""

from __future__ import annotations

import argparse
import asyncio
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from common.redis_spec import RedisSpec, parse_cluster_nodes
from common.sampling_params import SamplingParams
from engine.config import EngineConfig
from engine.outputs import CompletionOutput, RequestOutput
from engine.worker.engine_thread import EngineThread
from engine.worker.engine_worker import EngineWorker, WorkerConfig
from engine.worker.recovery import RecoveryState

SENTENCE = "the quick brown fox jumps over the lazy dog and runs far away. "


@dataclass(slots=True)
class _Request:
    prompt_len: int
    max_tokens: int
    generated: int  # tokens so far (a resumed request starts with those it had)


class FakeLLMEngine:
    """The part of `LLMEngine` the worker and its engine thread call, without a model (n = 1 only)."""

    def __init__(self, config: EngineConfig, tok_s: float, max_model_len: int = 4096) -> None:
        from tokenizers import Tokenizer

        self.config = config
        self.tok_s = tok_s
        self.tokenizer_dir = str(config.model)
        self.max_model_len = max_model_len
        tokenizer = Tokenizer.from_file(str(Path(config.model) / "tokenizer.json"))
        self.vocab_size = tokenizer.get_vocab_size()
        self.cycle = tokenizer.encode(SENTENCE, add_special_tokens=False).ids
        self.device = SimpleNamespace(type="cpu")
        self.parallel = None
        self.grammars = SimpleNamespace(prewarm=lambda: None)
        self.requests: dict[str, _Request] = {}
        self.tokens = 0
        self.runner_kind = "generate"  # announced in the heartbeat: a generating engine

    def lora_names(self) -> list[str]:
        """No LoRA adapters: the worker's adapter sync finds none to serve."""
        return []

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    generated: list[int] | None = None, **_: Any) -> None:
        """Queued as `LLMEngine.add_request` queues it (its adapter and pooling options ignored: the
        fake engine generates only)."""
        max_tokens = params.max_tokens if params.max_tokens is not None else 16
        self.requests[request_id] = _Request(len(prompt_token_ids), max_tokens, len(generated or []))

    def abort_request(self, request_id: str) -> bool:
        return self.requests.pop(request_id, None) is not None

    def has_request(self, request_id: str) -> bool:
        return request_id in self.requests

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def running_request_ids(self) -> list[str]:
        return list(self.requests)[: self.config.max_num_seqs]

    def waiting_request_ids(self) -> list[str]:
        return list(self.requests)[self.config.max_num_seqs:]

    def step(self) -> list[RequestOutput]:
        running = self.running_request_ids()
        time.sleep(len(running) / self.tok_s)
        outputs = []
        for request_id in running:
            req = self.requests[request_id]
            token = self.cycle[req.generated % len(self.cycle)]
            req.generated += 1
            done = req.generated >= req.max_tokens
            outputs.append(RequestOutput(request_id=request_id, outputs=[CompletionOutput(index=0, token_ids=[token],
                                         finish_reason="length" if done else None)],
                                         finished=done, num_prompt_tokens=req.prompt_len,
                                         num_generated_tokens=req.generated))
            if done:
                del self.requests[request_id]
        self.tokens += len(running)
        return outputs

    def take_refused(self) -> dict[str, tuple[str, str]]:
        return {}

    def queue_lengths(self) -> tuple[int, int, int]:
        running = min(len(self.requests), self.config.max_num_seqs)
        return running, len(self.requests) - running, 0

    def num_compiling(self) -> int:
        return 0

    def stats(self) -> dict[str, Any]:
        running, waiting, _ = self.queue_lengths()
        return {"num_running": running, "num_waiting": waiting, "num_swapped": 0, "generation_tokens": self.tokens}

    def block_tables(self) -> dict[str, list[int]]:
        return {}

    def cached_keys(self, limit: int) -> list[str]:
        return []

    def pool_snapshot(self) -> list[list[int]]:
        return []

    def close(self) -> None:
        self.requests.clear()


class FakeEngineThread(EngineThread):
    """The worker's engine thread, building a `FakeLLMEngine` instead of loading a model."""

    def __init__(self, recovery: RecoveryState, tok_s: float, cached_limit: int = 0) -> None:
        super().__init__(recovery, cached_limit)
        self.tok_s = tok_s

    def _build(self, config: EngineConfig) -> None:
        self.engine = FakeLLMEngine(config, self.tok_s)
        self.snapshot_cache = self.snapshot()


def fake_worker(engine_id: str, model_name: str, model_dir: str, redis_url: str, tok_s: float,
                max_num_seqs: int, redis: RedisSpec | None = None) -> EngineWorker:
    """A real `EngineWorker` whose engine thread runs a `FakeLLMEngine` (on `redis` when given:
    a Redis Cluster, say)."""
    return EngineWorker(WorkerConfig(engine_id=engine_id, model_name=model_name, redis_url=redis_url,
                                     redis=redis, drain_timeout_s=5.0),
                        EngineConfig(model=model_dir, max_num_seqs=max_num_seqs),
                        thread_factory=lambda recovery, cached_limit: FakeEngineThread(recovery, tok_s, cached_limit))


async def run_fleet(args: argparse.Namespace) -> None:
    spec = RedisSpec(cluster=parse_cluster_nodes(args.redis_cluster)) if args.redis_cluster else None
    workers = [fake_worker(f"{args.id_prefix}-{i}", args.model_name, args.model_dir, args.redis_url, args.tok_s,
                           args.max_num_seqs, spec) for i in range(args.engines)]
    def drain() -> None:
        for worker in workers:
            worker.stop.set()

    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, drain)
    await asyncio.gather(*(w.run() for w in workers))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--redis-cluster", metavar="HOST:PORT[,...]", help="a Redis Cluster instead of --redis-url")
    parser.add_argument("--model-name", default="bench")
    parser.add_argument("--model-dir", required=True, help="a model directory with tokenizer.json")
    parser.add_argument("--engines", type=int, default=1)
    parser.add_argument("--tok-s", type=float, default=1000.0, help="tokens a second each engine delivers")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--id-prefix", default="fake")
    asyncio.run(run_fleet(parser.parse_args()))


if __name__ == "__main__":
    main()
